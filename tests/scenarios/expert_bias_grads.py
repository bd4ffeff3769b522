"""Scenarios: the expert fc2 (RowParallelLinear) bias grad through the real MoE layer (issue 22/9).

Model: upstream's MoELayer from the local GPT layer spec (SequentialMLP of local
ColumnParallelLinear / RowParallelLinear experts, allgather token dispatcher, top-1 routing,
``add_bias_linear=True``) and beside it a dense RowParallelLinear with a bias, fp32, wrapped in
megatron DDP; one real forward/backward, then the real ``finalize_model_grads``.
Sequence parallelism is on whenever TP > 1 (upstream requires it for MoE with TP and EP). Every
param is set from its global name (expert params from their global expert index), and the global
batch [SEQ, GLOBAL_BATCH, HIDDEN] is split over dense DP (batch) and TP (sequence), so the model
and the data do not depend on the layout.

Expected values never come from a reduction under test: every rank records its own unreduced
grads (``main_grad`` after backward, before any sync) and all ranks exchange them. The correct
grad after ``finalize_model_grads`` (DDP averages over dense DP):
- an expert param: the sum over exactly the expert-DP replicas of its expert, / |dense DP|;
- a dense sequence-parallel param (router weight and bias, the dense layer's bias): the sum
  over every rank (TP x DP with PP = CP = 1), / |dense DP|;
- the dense layer's weight (a TP shard): the sum over the dense DP group, / |dense DP|.
Each layout also reports ``total``: per param, the sum of the unreduced grads of every rank that
holds it (the TP-split dense weight left out), which must be the same in every layout (each
token is processed once); the test compares it with TP = 1, EP = world, where nothing is
reduced at all.

The bug: the expert fc2 bias is marked ``sequence_parallel``, so ``finalize_model_grads`` also sums
it over the dense TP group, which holds other experts (EP > 1) or the expert-DP replicas that DDP
already summed (EP = 1 with expert params in the expert buffers, 0009 / upstream #5916).
"""

import torch

from tests.scenarios.common import stats_config
from tests.scenarios.expert_grad_stats import _groups as _group_sizes

NUM_EXPERTS = 4
HIDDEN = 8
FFN = 8
SEQ = 4  # sequence length (split over TP with sequence parallelism)
GLOBAL_BATCH = 4  # split over dense DP
SEED = 20261
EXPERT_PREFIX = 'experts.local_experts.'


def _config(tp, ep, etp):
    return stats_config(
        'fp32',
        tp,
        ep,
        etp,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        sequence_parallel=tp > 1,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_token_dispatcher_type='allgather',
        moe_router_load_balancing_type='none',
        add_bias_linear=True,
        use_cpu_initialization=True,
    )


def _moe_layer(config):
    """Upstream's MoELayer from the local GPT layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return spec.submodules.mlp(config=config)


class _Model(torch.nn.Module):
    """The MoE layer and, beside it, a dense RowParallelLinear with a bias: with sequence
    parallelism its bias needs the TP sum that the expert fc2 bias must not get."""

    def __init__(self, config):
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        super().__init__()
        self.moe = _moe_layer(config)
        self.dense = RowParallelLinear(
            HIDDEN,
            HIDDEN,
            config=config,
            init_method=config.init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )

    def forward(self, x, x_hidden_shard):
        """MoE on this rank's tokens; the dense layer on the replica's sequence, hidden-split
        over TP, giving this rank's sequence chunk (reduce-scatter with SP)."""
        return self.moe(x)[0], self.dense(x_hidden_shard)[0]


def _canonical(name, local_ids):
    """'moe.experts.local_experts.<local>.x' -> 'expert<global>.x'; 'moe.' dropped elsewhere."""
    name = name.removeprefix('moe.')
    if name.startswith(EXPERT_PREFIX):
        local, rest = name[len(EXPERT_PREFIX) :].split('.', 1)
        return f'expert{local_ids[int(local)]}.{rest}'
    return name


def _set_global_weights(model):
    """Each param from its canonical name (ETP = 1: expert params are whole; the dense weight
    differs per TP layout but no checked grad depends on it). Returns the canonical names of the
    module's params, in named_parameters order."""
    local_ids = list(model.moe.local_expert_indices)
    names = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            canonical = _canonical(name, local_ids)
            digest = sum(ord(c) * 31**i for i, c in enumerate(canonical)) % 2**31
            gen = torch.Generator().manual_seed(SEED + digest)
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            names.append(canonical)
    return names


def _local_data(dp, dp_rank, tp, tp_rank):
    """This rank's input and loss probe (its batch slice over dense DP and sequence chunk over
    TP), and the dense layer's input (the replica's whole sequence, its hidden slice over TP)."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(SEQ, GLOBAL_BATCH, HIDDEN, generator=gen)
    probe = torch.randn(SEQ, GLOBAL_BATCH, HIDDEN, generator=gen)
    b, s, h = GLOBAL_BATCH // dp, SEQ // tp, HIDDEN // tp
    batch, chunk = slice(dp_rank * b, (dp_rank + 1) * b), slice(tp_rank * s, (tp_rank + 1) * s)
    x_hidden_shard = x[:, batch, tp_rank * h : (tp_rank + 1) * h].contiguous()
    return x[chunk, batch].contiguous(), probe[chunk, batch].contiguous(), x_hidden_shard


def _groups():
    from megatron.core import parallel_state as ps

    ranks = torch.distributed.get_process_group_ranks
    return {
        **_group_sizes(None),
        'tp_ranks': ranks(ps.get_tensor_model_parallel_group()),
        'dp_ranks': ranks(ps.get_data_parallel_group()),
        'expert_dp_ranks': ranks(ps.get_expert_data_parallel_group()),
    }


def _layout(ctx, tp, ep, etp, mode):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(SEED)
    config = _config(tp, ep, etp)
    module = _Model(config)
    names = _set_global_weights(module)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module
    )
    params = dict(zip(names, model.module.parameters()))
    groups = _groups()
    if mode == 'fill':
        for p in params.values():
            p.main_grad.fill_(float(ctx.rank + 1))
    else:
        x, probe, x_hidden_shard = _local_data(
            groups['dp'], ps.get_data_parallel_rank(), tp, ps.get_tensor_model_parallel_rank()
        )
        moe_out, dense_out = model(x, x_hidden_shard)
        ((moe_out + dense_out) * probe).sum().backward()
    local = {n: p.main_grad.detach().double().clone() for n, p in params.items()}
    attrs = {
        n: {
            k: getattr(p, k, None)
            for k in ('allreduce', 'sequence_parallel', 'tensor_model_parallel')
        }
        for n, p in params.items()
    }
    finalize_model_grads([model])
    final = {n: p.main_grad.detach().double().clone() for n, p in params.items()}
    every = [None] * ctx.world_size
    torch.distributed.all_gather_object(every, local)
    return groups, attrs, final, every


def scenario_bias_grads(ctx, layout_list, mode='train'):
    """Per layout, each param's grad after finalize_model_grads against the correct value.

    Args:
        layout_list: list of [tp, ep, etp].
        mode: 'train' (one real forward/backward) or 'fill' (every main_grad set to rank + 1,
            then finalize_model_grads: the numbers read directly).

    Returns:
        {'cases': [per layout: 'layout', 'groups', 'params': {canonical name: 'got' and 'want'
        (first element), 'max_err', 'scale' (max |want|), 'allreduce', 'sequence_parallel'},
        'total': {every canonical name of the model: flat list}] } or, for a layout the config
        refuses (or upstream fails to run), {'layout', 'error'}.
    """
    from megatron.core import parallel_state as ps

    cases = []
    for tp, ep, etp in layout_list:
        try:
            groups, attrs, final, every = _layout(ctx, tp, ep, etp, mode)
        except (AssertionError, ValueError, RuntimeError) as exc:  # refused or failing upstream
            cases.append({'layout': [tp, ep, etp], 'error': f'{type(exc).__name__}: {exc}'})
            continue
        finally:
            ps.destroy_model_parallel()
        out, total = {}, {}
        for name, got in final.items():
            if name.startswith('expert'):
                replicas = groups['expert_dp_ranks']
            elif attrs[name]['tensor_model_parallel']:  # the dense weight: a TP shard
                replicas = groups['dp_ranks']
            else:
                replicas = range(ctx.world_size)
            want = sum(every[r][name] for r in replicas) / groups['dp']
            out[name] = {
                'got': float(got.flatten()[0]),
                'want': float(want.flatten()[0]),
                'max_err': float((got - want).abs().max()),
                'scale': float(want.abs().max()),
                **attrs[name],
            }
        for name in sorted({n for g in every for n in g} - {'dense.weight'}):
            total[name] = sum(g[name] for g in every if name in g).flatten().tolist()
        cases.append({'layout': [tp, ep, etp], 'groups': groups, 'params': out, 'total': total})
    return {'cases': cases}
