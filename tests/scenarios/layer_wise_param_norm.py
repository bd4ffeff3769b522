"""Scenario: the logged parameter norm after a ``LayerWiseDistributedOptimizer`` step.

``calc_params_l2_norm`` (megatron.training.utils) is read right after ``optimizer.step()``, as
``train_step``'s caller does for ``--log-params-norm``. With ``overlap_param_gather`` the
LayerWise all-gather of updated params is deferred to the next forward's pre-hooks, so at that
point a rank holds updated weights only for the params it owns.

The optimizer is built as ``_get_megatron_emerging_optimizer`` builds it for
``use_layer_wise_distributed_optimizer=True`` (see tests/scenarios/layer_wise_grad_stats.py), with
SGD as the base optimizer (Muon needs the ``emerging-optimizers`` package, not installed here; the
norm does not depend on the update rule). Values are exact in bf16: params ``1 + i / 4``, grads 1,
lr 1/2 and a first SGD step, so every updated param is ``1/2 + i / 4`` and the expected norm is a
closed form, never read from megatron.
"""

import math

import torch

from tests.scenarios.common import ParamBag, import_with_real_cuda, init_parallel, stats_config
from tests.scenarios.layer_wise_grad_stats import layer_wise_ddp, layer_wise_optimizer

# [rows, 2] bf16 matrices (LayerWise manages matrices only); x0 and x1 are experts
# (allreduce=False).
SHAPES = {'w0': 3, 'w1': 2, 'w2': 4, 'w3': 1, 'x0': 1, 'x1': 1}
LR = 0.5
PLAIN_SGD = dict(optimizer='sgd', lr=LR, min_lr=LR, weight_decay=0.0, sgd_momentum=0.0)


def _initial(name):
    base = sum(SHAPES[k] for k in SHAPES if k < name) * 2
    return [1.0 + (base + j) / 4.0 for j in range(SHAPES[name] * 2)]


def _norm(values):
    return math.sqrt(sum(v * v for v in values))


EXPECTED_BEFORE = _norm([v for k in SHAPES for v in _initial(k)])
EXPECTED_AFTER = _norm([v - LR for k in SHAPES for v in _initial(k)])


def _build(ctx, setup, overlap):
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = stats_config('bf16')
    values = {
        name: torch.tensor(_initial(name), dtype=torch.bfloat16).reshape(rows, 2).to(ctx.device)
        for name, rows in SHAPES.items()
    }
    module = ParamBag(values, expert_names=[name for name in SHAPES if name.startswith('x')])
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=setup == 'layout',
        overlap_param_gather=overlap,
        overlap_grad_reduce=overlap,
    )
    model = layer_wise_ddp(cfg, ddp_cfg, module, setup)
    optimizer = layer_wise_optimizer(
        model, setup == 'layout', overlap_param_gather=overlap, **PLAIN_SGD
    )
    return model, optimizer


def scenario_norm_after_step(ctx, setup='layout', overlap=True):
    """calc_params_l2_norm before and right after one step, and the params this rank holds.

    Returns:
        dict with ``before``/``after`` (this rank's calc_params_l2_norm), the closed-form
        ``expected_before``/``expected_after``, and ``stale``: how many param elements this rank
        still holds at their pre-step value after the step (the ones an overlapped gather has not
        refreshed yet).
    """
    from types import SimpleNamespace

    import_with_real_cuda('megatron.training.utils')
    from megatron.training.global_vars import set_args
    from megatron.training.utils import calc_params_l2_norm

    init_parallel()
    set_args(SimpleNamespace(bf16=True, use_megatron_fsdp=False))
    model, optimizer = _build(ctx, setup, overlap)
    before = float(calc_params_l2_norm([model]))
    for param in model.module.parameters():
        param.main_grad.fill_(1.0)
    optimizer.step()
    after = float(calc_params_l2_norm([model]))
    stale = 0
    for name in SHAPES:
        got = getattr(model.module, name).detach().float().reshape(-1)
        stale += int((got == torch.tensor(_initial(name))).sum())
    return {
        'before': before,
        'after': after,
        'expected_before': EXPECTED_BEFORE,
        'expected_after': EXPECTED_AFTER,
        'stale': stale,
    }
