"""Scenarios: the logged parameter norm (``megatron.training.utils.calc_params_l2_norm``).

Every scenario runs on all ranks of a harness world, initialises model parallel state itself and
returns a JSON-able dict. The parameters are DDP-wrapped and handed to the real
``get_megatron_optimizer`` (so bf16 runs have ``main_param`` copies, and distributed-optimizer runs
have sharded ``main_param`` views), then ``calc_params_l2_norm`` is read. The expected values never
come from megatron: they are the FP64 norm of the *logical* (deduplicated) parameters that the
per-rank shards were cut from.

The logical model is the one of ``tests.scenarios.expert_grad_stats`` (dense replicated, dense
TP-split, expert replicated over ETP, expert ETP-split), with the random draws used as parameter
values instead of gradients. They are multiples of 1/8 in [-2, 2], exact in bf16 and fp32.
"""

import math
from types import SimpleNamespace

import torch

from tests.scenarios.expert_grad_stats import (
    DENSE_REP,
    DENSE_TP_SHARD,
    EXPERT_REP,
    EXPERT_TP_SHARD,
    _local,
    _logical,
)

DTYPES = {'bf16': torch.bfloat16, 'fp32': torch.float32}
# (dtype, use_distributed_optimizer): the four optimizer paths calc_params_l2_norm reads from.
# bf16 without DistOpt: full fp32 main_param copies; bf16 with DistOpt: sharded main_param views;
# fp32 with or without DistOpt: the model params themselves.
OPTIMIZER_KINDS = (('bf16', False), ('bf16', True), ('fp32', False), ('fp32', True))
SHAPES = {
    'dense_rep': DENSE_REP,
    'dense_tp': DENSE_TP_SHARD,
    'expert_rep': EXPERT_REP,
    'expert_tp': EXPERT_TP_SHARD,
}
EXPERT_NAMES = ('expert_rep', 'expert_tp')
TP_NAMES = ('dense_tp', 'expert_tp')


class _Params(torch.nn.Module):
    """A bag of 1-D parameters with given values; DDP and the optimizers need only parameters."""

    def __init__(self, values, expert_names, tp_names, dtype, device):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for name, value in values.items():
            param = torch.nn.Parameter(value.to(dtype=dtype, device=device).clone())
            if name in tp_names:
                set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
            if name in expert_names:
                param.allreduce = False
            setattr(self, name, param)


def _import_training_utils():
    """Import ``megatron.training.utils`` with the real ``torch.cuda`` bound.

    Its imports reach modules (e.g. the nvshmem resharding service) that read ``torch.cuda``
    attributes at import time only, which the CPU redirect rejects. No CUDA work happens here.
    """
    import sys

    if 'megatron.training.utils' in sys.modules:
        return
    try:
        from tests.harness import cpu_redirect
    except ImportError:
        cpu_redirect = None
    if cpu_redirect is None or not cpu_redirect.installed():
        import megatron.training.utils  # noqa: F401

        return
    proxy = torch.cuda
    torch.cuda = cpu_redirect._REAL_CUDA
    try:
        import megatron.training.utils  # noqa: F401
    finally:
        torch.cuda = proxy


def _set_args(dtype):
    """calc_params_l2_norm reads only ``bf16`` and ``use_megatron_fsdp`` from the global args."""
    _import_training_utils()
    from megatron.training.global_vars import set_args

    set_args(SimpleNamespace(bf16=dtype == 'bf16', use_megatron_fsdp=False))


def _build(ctx, tp, values, expert_names, tp_names, dtype, use_distributed_optimizer):
    """DDP-wrap the parameters and build the standard optimizer (chained dense + expert)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        bf16=dtype == 'bf16',
        params_dtype=DTYPES[dtype],
    )
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
    )
    module = _Params(values, expert_names, tp_names, DTYPES[dtype], ctx.device)
    model = DistributedDataParallel(cfg, ddp_cfg, module)
    opt_cfg = OptimizerConfig(
        optimizer='adam',
        lr=0.0,
        bf16=dtype == 'bf16',
        use_distributed_optimizer=use_distributed_optimizer,
        clip_grad=0.0,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [model], use_gloo_process_groups=False)
    return model, optimizer


def _param_norms(model, dtype):
    """calc_params_l2_norm from the optimizer's copies and from fresh fp32 copies."""
    _set_args(dtype)
    from megatron.training.utils import calc_params_l2_norm

    return {
        'norm': float(calc_params_l2_norm([model])),
        'norm_fp32_copy': float(calc_params_l2_norm([model], force_create_fp32_copy=True)),
    }


def scenario_exact_oracle(ctx, dtype, use_distributed_optimizer):
    """TP = EP = world, ETP = 1: one replicated dense scalar, one distinct expert scalar per rank.

    Every value is 1.

    Expected: sqrt(1 + world). Deduplicating the expert scalar over the dense TP group keeps only
    TP rank 0's expert and gives sqrt(2).
    """
    from megatron.core import parallel_state as ps

    world = ctx.world_size
    ps.initialize_model_parallel(
        tensor_model_parallel_size=world,
        expert_model_parallel_size=world,
        expert_tensor_parallel_size=1,
    )
    values = {'dense': torch.ones(1), 'expert': torch.ones(1)}
    model, _ = _build(ctx, world, values, {'expert'}, set(), dtype, use_distributed_optimizer)
    out = _param_norms(model, dtype)
    out.update(
        {
            'dtype': dtype,
            'distopt': use_distributed_optimizer,
            'expected_norm': math.sqrt(1 + world),
            'buggy_norm': math.sqrt(2),
        }
    )
    return out


def scenario_layouts(ctx, layout_list, seeds, kinds=OPTIMIZER_KINDS):
    """Random parameter values over several (tp, ep, etp) layouts and optimizer kinds in one world.

    Args:
        layout_list: list of [tp, ep, etp]; each is initialised, measured and destroyed in turn.
        seeds: parameter draws per layout and optimizer kind.
        kinds: list of [dtype, use_distributed_optimizer].

    Returns:
        {'cases': [...]} with, per (layout, dtype, distopt, seed), the reported param norms
        (optimizer copies and fresh fp32 copies) and the FP64 norm of the logical parameters.
    """
    from megatron.core import parallel_state as ps

    cases = []
    for tp, ep, etp in layout_list:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        try:
            coords = (
                ps.get_tensor_model_parallel_rank(),
                ps.get_expert_model_parallel_rank(),
                ps.get_expert_tensor_parallel_rank(),
            )
            for dtype, distopt in kinds:
                for seed in seeds:
                    logical = _logical(seed, tp, ep, etp)
                    local = {k: v.float() for k, v in _local(logical, *coords).items()}
                    model, _ = _build(ctx, tp, local, EXPERT_NAMES, TP_NAMES, dtype, distopt)
                    got = _param_norms(model, dtype)
                    flat = torch.cat([v.reshape(-1) for v in logical.values()])
                    cases.append(
                        {
                            'layout': [tp, ep, etp],
                            'dtype': dtype,
                            'distopt': distopt,
                            'seed': seed,
                            'norm': got['norm'],
                            'norm_fp32_copy': got['norm_fp32_copy'],
                            'oracle_norm': float(flat.pow(2).sum().sqrt()),
                        }
                    )
                    del model
        finally:
            ps.destroy_model_parallel()
    return {'cases': cases}
