"""Scenario: ``get_grad_norm_fp32`` on a rank whose grads are all filtered out (patch 0017).

A DDP-wrapped fp32 model and the real ``get_megatron_optimizer``; every main_grad is set, the
optimizer's own ``prepare_grads`` and grad filter (shared params, TP duplicates) give the list
that ``get_grad_norm_fp32`` reduces with the optimizer's grad-stats group, for the inf norm, the
L1 and L3 norms and the L2 norm. Expected values are computed in FP64 from the logical grads.
"""

import math

import torch

NORM_TYPES = ['inf', 1.0, 2.0, 3.0]
VALUES = [1.0, -2.0, 0.5]


def scenario_norms(ctx, tp, shared):
    """Args:
        tp: tensor-parallel size (the params are not tensor-parallel, so TP ranks > 0 filter
            every grad out as a TP duplicate).
        shared: mark every param ``shared`` (as a tied embedding's second copy), so every rank
            filters every grad out.

    Returns:
        {'sizes': per-rank list length, 'norms': {norm type: value or 'error'}, 'expected': ...}
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=4, tensor_model_parallel_size=tp
    )
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(len(VALUES), device=ctx.device))
    if shared:
        module.weight.shared = True
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer='adam', lr=0.0, clip_grad=0.0), [model])
    model.module.weight.main_grad.copy_(torch.tensor(VALUES))
    opt.prepare_grads()
    child = getattr(opt, 'chained_optimizers', [opt])[0]
    get = getattr(child, 'get_grads_for_grad_norm', None) or child.get_main_grads_for_grad_norm
    grads = get()
    norms = {}
    for norm_type in NORM_TYPES:
        p = float(norm_type)
        try:
            norms[str(norm_type)] = float(
                get_grad_norm_fp32(
                    grads,
                    norm_type=p,
                    grad_stats_parallel_group=child.get_grad_stats_parallel_group(),
                )
            )
        except Exception as exc:  # pylint: disable=broad-except
            norms[str(norm_type)] = f'{type(exc).__name__}: {exc}'
    if shared:
        expected = {str(n): 0.0 for n in NORM_TYPES}
    else:
        expected = {
            str(n): (
                max(abs(v) for v in VALUES)
                if n == 'inf'
                else math.fsum(abs(v) ** n for v in VALUES) ** (1.0 / n)
            )
            for n in NORM_TYPES
        }
    return {'size': len(grads), 'norms': norms, 'expected': expected}
