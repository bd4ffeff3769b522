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

from tests.scenarios.common import (
    ParamBag,
    ddp_and_optimizer,
    import_with_real_cuda,
    init_parallel,
    oracle,
    parallel_layout,
    stats_config,
)
from tests.scenarios.expert_grad_stats import EXPERT_NAMES, TP_NAMES, _local, _logical

DTYPES = {'bf16': torch.bfloat16, 'fp32': torch.float32}
# (dtype, use_distributed_optimizer): the four optimizer paths calc_params_l2_norm reads from.
# bf16 without DistOpt: full fp32 main_param copies; bf16 with DistOpt: sharded main_param views;
# fp32 with or without DistOpt: the model params themselves.
OPTIMIZER_KINDS = (('bf16', False), ('bf16', True), ('fp32', False), ('fp32', True))


def _set_args(dtype):
    """calc_params_l2_norm reads only ``bf16`` and ``use_megatron_fsdp`` from the global args."""
    import_with_real_cuda('megatron.training.utils')
    from megatron.training.global_vars import set_args

    set_args(SimpleNamespace(bf16=dtype == 'bf16', use_megatron_fsdp=False))


def _build(ctx, tp, values, expert_names, tp_names, dtype, use_distributed_optimizer):
    """DDP-wrap the parameters and build the standard optimizer (chained dense + expert)."""
    values = {k: v.to(dtype=DTYPES[dtype], device=ctx.device) for k, v in values.items()}
    module = ParamBag(values, expert_names, tp_names)
    return ddp_and_optimizer(stats_config(dtype, tp=tp), module, use_distributed_optimizer)


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
    world = ctx.world_size
    init_parallel(tp=world, ep=world, etp=1)
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
    cases = []
    for tp, ep, etp in layout_list:
        with parallel_layout(tp, ep, etp) as coords:
            for dtype, distopt in kinds:
                for seed in seeds:
                    logical = _logical(seed, tp, ep, etp)
                    local = {k: v.float() for k, v in _local(logical, *coords).items()}
                    model, _ = _build(ctx, tp, local, EXPERT_NAMES, TP_NAMES, dtype, distopt)
                    got = _param_norms(model, dtype)
                    cases.append(
                        {
                            'layout': [tp, ep, etp],
                            'dtype': dtype,
                            'distopt': distopt,
                            'seed': seed,
                            'norm': got['norm'],
                            'norm_fp32_copy': got['norm_fp32_copy'],
                            'oracle_norm': oracle(logical)['oracle_norm'],
                        }
                    )
                    del model
    return {'cases': cases}
