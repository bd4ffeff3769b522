"""Scenarios: expert-aware gradient statistics (grad norm, zero count) of the standard optimizers.

Every scenario runs on all ranks of a harness world, initialises model parallel state itself and
returns a JSON-able dict. The expected values never come from megatron: they are computed from the
*logical* (deduplicated) parameters that the per-rank shards were cut from, in FP64.

Logical model used by the layout scenarios (all parameters bf16, PP = CP = 1; the exact oracle
also runs fp16 and fp32 models, whose optimizers take other code paths):
- ``dense_rep``: replicated over TP and DP (not tensor-parallel), 3 elements.
- ``dense_tp``: tensor-parallel over TP (partition_dim 0), 2 elements per TP rank.
- ``expert_rep``: one distinct tensor per EP rank, replicated over ETP and expert DP, 3 elements,
  ``allreduce=False``.
- ``expert_tp``: one distinct tensor per EP rank, tensor-parallel over ETP, 2 elements per ETP
  rank, ``allreduce=False``.
"""

import math

import torch

from tests.scenarios.common import (
    ParamBag,
    ddp_and_optimizer,
    init_parallel,
    oracle,
    parallel_layout,
    read_grad_stats,
    stats_config,
)

DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}

DENSE_REP, DENSE_TP_SHARD, EXPERT_REP, EXPERT_TP_SHARD = 3, 2, 3, 2
# The logical model's local parameters: name -> elements on one rank; the expert and the
# tensor-parallel ones.
SHAPES = {
    'dense_rep': DENSE_REP,
    'dense_tp': DENSE_TP_SHARD,
    'expert_rep': EXPERT_REP,
    'expert_tp': EXPERT_TP_SHARD,
}
EXPERT_NAMES = ('expert_rep', 'expert_tp')
TP_NAMES = ('dense_tp', 'expert_tp')
SEED = 1234


def layouts(world_size):
    """Every (tp, ep, etp) with PP = CP = 1 that fits ``world_size`` ranks."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    out = []
    for tp in divisors:
        for ep in divisors:
            for etp in divisors:
                if world_size % (ep * etp) == 0:
                    out.append((tp, ep, etp))
    return out


def _build(
    ctx,
    tp,
    shapes,
    expert_names,
    tp_names,
    use_distributed_optimizer,
    dtype='bf16',
    pg_collection=False,
    optimizer='adam',
):
    """DDP-wrap the parameters and build the standard optimizer (chained dense + expert).

    Args:
        dtype: 'bf16', 'fp16' (constant loss scale 1, so grads are read as written) or 'fp32'
            (FP32Optimizer, or the DistributedOptimizer's fp32 branch).
        pg_collection: pass ProcessGroupCollection.use_mpu_process_groups() explicitly to
            get_megatron_optimizer instead of letting it read the global parallel state.
        optimizer: 'adam', or an emerging optimizer such as 'lion' (needs the
            emerging-optimizers package; get_megatron_optimizer then takes its emerging path).
    """
    torch.manual_seed(SEED)
    cfg = stats_config(dtype, tp=tp)
    zeros = {n: torch.zeros(k, dtype=DTYPES[dtype], device=ctx.device) for n, k in shapes.items()}
    factory_kwargs = {}
    if pg_collection:
        from megatron.core.process_groups_config import ProcessGroupCollection

        factory_kwargs['pg_collection'] = ProcessGroupCollection.use_mpu_process_groups()
    return ddp_and_optimizer(
        cfg,
        ParamBag(zeros, expert_names, tp_names),
        use_distributed_optimizer,
        factory_kwargs,
        optimizer=optimizer,
        fp16=dtype == 'fp16',
        loss_scale=1.0 if dtype == 'fp16' else None,
        params_dtype=DTYPES[dtype],
        log_num_zeros_in_grad=True,
    )


def _children(optimizer):
    return list(getattr(optimizer, 'chained_optimizers', [optimizer]))


def _expert_allreduce_seen(optimizer):
    """``allreduce`` of every param the expert child optimizer holds (None when absent)."""
    seen = []
    for child in _children(optimizer):
        for param in child.get_parameters():
            seen.append(getattr(param, 'allreduce', None))
    return seen


def _stats(model, optimizer, grads):
    """Write ``grads`` (name -> local tensor) into main_grad and read the optimizer's statistics."""
    return read_grad_stats(optimizer, [(getattr(model.module, n), v) for n, v in grads.items()])


def _groups(ctx):
    from megatron.core import parallel_state as ps

    return {
        'tp': ps.get_tensor_model_parallel_world_size(),
        'ep': ps.get_expert_model_parallel_world_size(),
        'etp': ps.get_expert_tensor_parallel_world_size(),
        'dp': ps.get_data_parallel_world_size(),
        'expert_dp': ps.get_expert_data_parallel_world_size(),
    }


def scenario_exact_oracle(
    ctx,
    use_distributed_optimizer,
    dtype='bf16',
    pg_collection=False,
    optimizer='adam',
    matrix=False,
):
    """TP = EP = world, ETP = 1: one replicated dense scalar, one distinct expert scalar per rank.

    Expected: grads all 1 -> norm sqrt(1 + world); grads all 0 -> zero count 1 + world.
    dtype, pg_collection and optimizer are passed to _build; matrix: the two scalars are 1x1
    matrices (emerging optimizers such as Lion take 2-D params themselves and hand 1-D ones to
    their Adam fallback, so only 2-D params reach the emerging wrapper's call site).
    """
    from megatron.core import parallel_state as ps

    world = ctx.world_size
    init_parallel(tp=world, ep=world, etp=1)
    model, optimizer = _build(
        ctx,
        world,
        {'dense': (1, 1) if matrix else 1, 'expert': (1, 1) if matrix else 1},
        {'expert'},
        set(),
        use_distributed_optimizer,
        dtype=dtype,
        pg_collection=pg_collection,
        optimizer=optimizer,
    )
    ones = _stats(model, optimizer, {'dense': torch.ones(1), 'expert': torch.ones(1)})
    zeros = _stats(model, optimizer, {'dense': torch.zeros(1), 'expert': torch.zeros(1)})
    children = _children(optimizer)
    return {
        'groups': _groups(ctx),
        'norm': ones['norm'],
        'zeros': zeros['zeros'],
        'expected_norm': math.sqrt(1 + world),
        'expected_zeros': 1 + world,
        'found_inf': ones['found_inf'] or zeros['found_inf'],
        'children': [type(c).__name__ for c in children],
        'param_dtypes': sorted({str(p.dtype) for p in model.module.parameters()}),
        'children_expert_tp_group_is_etp': [
            getattr(c, 'expert_tp_group', None) is ps.get_expert_tensor_parallel_group()
            for c in children
        ],
        'children_tp_group_is_tp': [
            getattr(c, 'tp_group', None) is ps.get_tensor_model_parallel_group() for c in children
        ],
        'expert_allreduce_seen': _expert_allreduce_seen(optimizer),
    }


def _logical(seed, tp, ep, etp):
    """Logical gradients (FP64 and exactly representable in bf16) for one draw."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        # Multiples of 1/8 in [-2, 2]: exact in bf16; about 1 in 9 is zero; some draws all zero.
        vals = torch.randint(-16, 17, shape, generator=gen).double() / 8.0
        mask = torch.rand(shape, generator=gen) < 0.2
        return vals.masked_fill(mask, 0.0)

    return {
        'dense_rep': draw(DENSE_REP),
        'dense_tp': draw(tp * DENSE_TP_SHARD),
        'expert_rep': draw(ep, EXPERT_REP),
        'expert_tp': draw(ep, etp * EXPERT_TP_SHARD),
    }


def _local(logical, tp_rank, ep_rank, etp_rank):
    d, e = DENSE_TP_SHARD, EXPERT_TP_SHARD
    return {
        'dense_rep': logical['dense_rep'],
        'dense_tp': logical['dense_tp'][tp_rank * d : (tp_rank + 1) * d],
        'expert_rep': logical['expert_rep'][ep_rank],
        'expert_tp': logical['expert_tp'][ep_rank][etp_rank * e : (etp_rank + 1) * e],
    }


def scenario_layouts(ctx, seeds, layout_list=None, use_distributed_optimizer_values=(False, True)):
    """Random gradients over several (tp, ep, etp) layouts in one world.

    Args:
        layout_list: list of [tp, ep, etp]; each is initialised, measured and destroyed in turn
            (None: every layout of this world, :func:`layouts`).
        seeds: gradient draws per layout (one logical draw per seed, sharded per rank).
        use_distributed_optimizer_values: optimizer kinds to build per layout.

    Returns:
        {'cases': [...]} with, per (layout, optimizer, seed): the reported norm and zero count and
        the FP64 oracle over the logical parameters.
    """
    return layout_cases(
        ctx,
        layouts(ctx.world_size) if layout_list is None else layout_list,
        seeds,
        'distopt',
        use_distributed_optimizer_values,
        lambda tp, distopt: _build(ctx, tp, SHAPES, EXPERT_NAMES, TP_NAMES, distopt),
    )


def layout_cases(ctx, layout_list, seeds, key, variants, build):
    """Per layout, variant and seed: the reported grad norm and zero count of the optimizer that
    ``build(tp, variant)`` makes over SHAPES, against the FP64 oracle of the logical draw.

    Returns:
        {'cases': [...]}, each with layout, ``key``: variant, seed, norm, zeros, oracle_norm and
        oracle_zeros.
    """
    cases = []
    for tp, ep, etp in layout_list:
        with parallel_layout(tp, ep, etp) as coords:
            for variant in variants:
                model, optimizer = build(tp, variant)
                for seed in seeds:
                    logical = _logical(seed, tp, ep, etp)
                    local = {k: v.float() for k, v in _local(logical, *coords).items()}
                    got = _stats(model, optimizer, local)
                    cases.append(
                        {
                            'layout': [tp, ep, etp],
                            key: variant,
                            'seed': seed,
                            'norm': got['norm'],
                            'zeros': got['zeros'],
                            **oracle(logical),
                        }
                    )
                del model, optimizer
    return {'cases': cases}


def _layer_config(tp, ep, etp):
    """The bf16 config of the expert layers (MoE fields when EP > 1, no biases when ETP > 1)."""
    kwargs = {}
    if ep > 1:
        kwargs = {'num_moe_experts': ep, 'moe_router_topk': 1, 'moe_router_pre_softmax': True}
        if etp > 1:
            kwargs['add_bias_linear'] = False  # upstream: MoE biases need ETP == 1
    return stats_config(
        'bf16',
        tp,
        ep,
        etp,
        sequence_parallel=tp > 1,
        use_cpu_initialization=True,
        perform_initialization=False,
        **kwargs,
    )


def _expert_ddp(cfg, hidden, ffn, bias):
    """An expert ColumnParallelLinear and RowParallelLinear pair, wrapped in DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    class _Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            common = dict(config=cfg, init_method=lambda w: None, is_expert=True)
            self.fc1 = ColumnParallelLinear(
                hidden, ffn, bias=bias, gather_output=False, skip_bias_add=True, **common
            )
            self.fc2 = RowParallelLinear(
                ffn, hidden, bias=bias, input_is_parallel=True, skip_bias_add=True, **common
            )

    return DistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), _Experts()
    )


def _sync(ctx, model, params, names):
    """Gradient synchronisation of ``rank + 1`` grads: (synced, expert-DP ranks, correct value)."""
    from megatron.core import parallel_state as ps

    for n in names:
        params[n].main_grad.fill_(float(ctx.rank + 1))
    model.finish_grad_sync()
    synced = {n: float(params[n].main_grad.flatten()[0]) for n in names}
    edp = ps.get_expert_data_parallel_group()
    edp_ranks = torch.distributed.get_process_group_ranks(edp)
    # DDP scales every grad by 1/|dense DP| and sums over the group that owns the param; an expert
    # param is owned by the expert-DP group.
    dense_dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    correct = sum(r + 1 for r in edp_ranks) / dense_dp
    return synced, edp_ranks, correct


def _ones_norm(model, params, names):
    """Grad norm with all-ones grads (bf16 optimizer, non-distributed)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer='adam', lr=0.0, bf16=True, clip_grad=0.0),
        [model],
        use_gloo_process_groups=False,
    )
    for n in names:
        params[n].main_grad.fill_(1.0)
    opt.prepare_grads()
    return float(opt.get_grad_norm())


def scenario_expert_layer_sync(ctx, tp, ep, etp):
    """Item 6: real expert linear layers with EP = 1 and ETP != TP (or any layout).

    Builds an expert ColumnParallelLinear and RowParallelLinear (both with a bias) from
    megatron's local tensor-parallel layers, wraps them in DDP and reports:
    - the ``allreduce`` flag each layer put on its params and the DDP buffer kind (dense or expert)
      that holds them, with the size of the data-parallel group that reduces that buffer;
    - gradient synchronisation: every rank writes ``rank + 1`` into every main_grad and runs
      ``finish_grad_sync``; correct sync sums an expert param over the expert-DP group only
      (after DDP's 1/|dense DP| scaling);
    - the grad norm with all-ones grads against the logical count of expert weight elements.
    """
    init_parallel(tp=tp, ep=ep, etp=etp)
    torch.manual_seed(SEED)
    hidden, ffn = 4, 8
    cfg = _layer_config(tp, ep, etp)

    # Upstream refuses biases on MoE experts with ETP > 1 (TransformerConfig is MoE when EP > 1).
    bias = not (ep > 1 and etp > 1)
    model = _expert_ddp(cfg, hidden, ffn, bias)
    names = ['fc1.weight', 'fc2.weight']
    if bias:
        names = ['fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias']
    params = dict(model.module.named_parameters())
    expert_buffer_params = {p for b in model.expert_parallel_buffers for p in b.params}
    placement = {n: ('expert' if params[n] in expert_buffer_params else 'dense') for n in names}
    allreduce = {n: getattr(params[n], 'allreduce', None) for n in names}
    shapes = {n: list(params[n].shape) for n in names}

    synced, edp_ranks, correct = _sync(ctx, model, params, names)
    norm = _ones_norm(model, params, names)
    # Logical expert elements: fc1/fc2 weights and the fc1 bias are split over ETP, distinct per
    # EP rank; the fc2 bias (not tensor-parallel) is replicated over ETP. Each expert (EP rank)
    # owns one copy.
    logical = ep * (hidden * ffn + ffn * hidden + ((ffn + hidden) if bias else 0))
    return {
        'groups': _groups(ctx),
        'allreduce': allreduce,
        'buffer': placement,
        'shapes': shapes,
        'expert_dp_ranks': edp_ranks,
        'grad_after_sync': synced,
        'correct_grad_after_sync': correct,
        'norm': norm,
        'expected_norm': math.sqrt(logical),
    }


def scenario_expert_layer_sync_layouts(ctx, layout_list):
    """``scenario_expert_layer_sync`` over several (tp, ep, etp) layouts in one world.

    Returns:
        {'cases': [per layout: layout, whether every expert grad equals the expert-DP sum after
        finish_grad_sync on this rank, and whether the grad norm equals sqrt(logical elements)]}.
    """
    from megatron.core import parallel_state as ps

    cases = []
    for tp, ep, etp in layout_list:
        try:
            res = scenario_expert_layer_sync(ctx, tp, ep, etp)
        finally:
            ps.destroy_model_parallel()
        cases.append(
            {
                'layout': [tp, ep, etp],
                'buffer': sorted(set(res['buffer'].values())),
                'grads_ok': set(res['grad_after_sync'].values())
                == {res['correct_grad_after_sync']},
                'norm_ok': math.isclose(res['norm'], res['expected_norm'], rel_tol=1e-6),
            }
        )
    return {'cases': cases}
