"""Scenarios: gradient statistics (grad norm, zero count) of ``LayerWiseDistributedOptimizer``.

Every scenario runs on all ranks of a harness world, initialises model parallel state itself and
returns a JSON-able dict. The expected values never come from megatron: they are computed in FP64
from the *logical* (deduplicated) gradients the per-rank shards were cut from.

The optimizer is built the way ``_get_megatron_emerging_optimizer`` builds it for
``use_layer_wise_distributed_optimizer=True``: ``_get_param_groups`` (dense and expert groups
together, tagged ``is_expert_parallel``), base torch optimizers from
``_get_megatron_optimizer_based_on_param_groups(skip_megatron_wrapping=True)``, then the real
``LayerWiseDistributedOptimizer``, which shards the params over the dense and expert DP groups and
wraps the children for bf16. Muon itself needs the ``emerging-optimizers`` package, which is not
installed here; the base optimizer is Adam, which LayerWise also hosts (the legacy path feeds
non-Muon groups into it). The statistics do not depend on the update rule.

Two DDP set-ups, as ``wrap_model_chunks_with_ddp`` makes them:
- ``legacy``: plain DDP (all-reduce), LayerWise shards by its ping-pong rule and all-gathers
  parameters itself;
- ``layout``: DDP with the distributed-optimizer buffers and the shard-aligned layout from
  ``LayerWiseDistributedOptimizer.compute_full_param_layout`` (reduce-scatter).

The logical model is that of ``tests.scenarios.expert_grad_stats``, with every parameter a matrix
(``[n, 1]``) so that LayerWise manages it on both set-ups.
"""

import math

import torch

from tests.scenarios.common import ParamBag, init_parallel, parallel_layout, stats_config
from tests.scenarios.expert_grad_stats import (
    EXPERT_NAMES,
    SHAPES,
    TP_NAMES,
    _groups,
    _local,
    _logical,
    _stats,
    layout_cases,
)

SETUPS = ('legacy', 'layout')


def _build(ctx, tp, shapes, expert_names, tp_names, setup):
    """DDP-wrap ``[n, 1]`` bf16 parameters (LayerWise manages matrices only) and build a
    LayerWiseDistributedOptimizer over them."""
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = stats_config('bf16', tp=tp)
    zeros = {
        n: torch.zeros(k, 1, dtype=torch.bfloat16, device=ctx.device) for n, k in shapes.items()
    }
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=setup == 'layout'
    )
    model = layer_wise_ddp(cfg, ddp_cfg, ParamBag(zeros, expert_names, tp_names), setup)
    return model, layer_wise_optimizer(model, optimizer='adam', lr=0.0, log_num_zeros_in_grad=True)


def layer_wise_ddp(cfg, ddp_cfg, module, setup):
    """DDP over ``module`` as ``wrap_model_chunks_with_ddp`` makes it for LayerWise: 'legacy' is
    plain DDP; 'layout' tags the params for buffer routing and passes the shard-aligned layout of
    ``LayerWiseDistributedOptimizer.compute_full_param_layout``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    kwargs = {}
    if setup == 'layout':
        tag_params_for_buffer_routing([module])
        kwargs['full_param_layout'] = LayerWiseDistributedOptimizer.compute_full_param_layout(
            [p for p in module.parameters() if p.requires_grad],
            ddp_cfg.bucket_size,
            ps.get_data_parallel_world_size(with_context_parallel=True),
            ddp_cfg,
            expert_data_parallel_world_size=ps.get_expert_data_parallel_world_size(),
        )
    return DistributedDataParallel(cfg, ddp_cfg, module, **kwargs)


def layer_wise_optimizer(model, param_layout=None, **opt_kwargs):
    """The LayerWiseDistributedOptimizer of ``model`` built as the optimizer factory builds it,
    bf16 without clipping; ``opt_kwargs`` are the other OptimizerConfig fields. ``param_layout``
    sets use_layer_wise_param_layout where the base has it (None: its default)."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_megatron_optimizer_based_on_param_groups,
        _get_param_groups,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    opt_cfg = OptimizerConfig(
        bf16=True, clip_grad=0.0, use_layer_wise_distributed_optimizer=True, **opt_kwargs
    )
    if param_layout is not None and hasattr(opt_cfg, 'use_layer_wise_param_layout'):
        opt_cfg.use_layer_wise_param_layout = param_layout
    groups = _get_param_groups([model], opt_cfg, get_standard_config_overrides(opt_cfg))
    # The raw torch optimizer: LayerWise shards the params, then wraps it for bf16.
    base, init_fn = _get_megatron_optimizer_based_on_param_groups(
        opt_cfg, [model], groups, skip_megatron_wrapping=True
    )
    return LayerWiseDistributedOptimizer(
        [base],
        opt_cfg,
        ProcessGroupCollection.use_mpu_process_groups(),
        init_state_fn_list=[init_fn],
        model_chunks=[model],
    )


def scenario_exact_oracle(ctx, tp, ep, etp, setup):
    """One dense ``[1, 1]`` matrix and two expert ones; grads all 1 (norm) or all 0 (zero count).

    The dense matrix is one logical tensor, replicated over TP and DP. Each EP rank owns one
    logical ``expert_bias`` (not tensor-parallel, so replicated over ETP and expert DP) and one
    ``expert_weight`` (marked tensor-parallel, as expert linear weights are, so with ETP = 1 it is
    a whole tensor replicated over expert DP). Expected, whatever TP, ETP and the DP sizes:
    norm sqrt(1 + 2 EP), zero count 1 + 2 EP.
    """
    assert etp == 1, 'expert_weight is a whole tensor only with ETP = 1'
    init_parallel(tp=tp, ep=ep, etp=etp)
    shapes = {'dense': 1, 'expert_bias': 1, 'expert_weight': 1}
    model, optimizer = _build(
        ctx, tp, shapes, {'expert_bias', 'expert_weight'}, {'expert_weight'}, setup
    )
    ones = _stats(model, optimizer, {name: torch.ones(1) for name in shapes})
    zeros = _stats(model, optimizer, {name: torch.zeros(1) for name in shapes})
    return {
        'groups': _groups(ctx),
        'setup': setup,
        'norm': ones['norm'],
        'zeros': zeros['zeros'],
        'expected_norm': math.sqrt(1 + 2 * ep),
        'expected_zeros': 1 + 2 * ep,
        'found_inf': ones['found_inf'] or zeros['found_inf'],
    }


def scenario_layouts(ctx, layout_list, seeds, setups=SETUPS):
    """Random gradients over several (tp, ep, etp) layouts and both DDP set-ups in one world.

    Args:
        layout_list: list of [tp, ep, etp]; each is initialised, measured and destroyed in turn.
        seeds: gradient draws per layout and set-up.
        setups: DDP set-ups to build ('legacy', 'layout').

    Returns:
        {'cases': [...]} with, per (layout, setup, seed), the reported norm and zero count and
        the FP64 oracle over the logical gradients.
    """
    return layout_cases(
        ctx,
        layout_list,
        seeds,
        'setup',
        setups,
        lambda tp, setup: _build(ctx, tp, SHAPES, EXPERT_NAMES, TP_NAMES, setup),
    )


def scenario_step(ctx, layout_list, seed, setups=SETUPS, lr=0.5):
    """One real optimizer step per layout and set-up: every rank must end with the right params.

    The params start at 0 and the step is Adam's first (lr ``lr``, no clipping), so each element
    moves by ``-lr * g / (|g| + eps)``, which is ``-lr * sign(g)`` once rounded to bf16. A rank
    that updates a param it does not own, or misses the all-gather of one it does not own, ends
    with a different value. Gradients are the local shards of one logical draw, identical on
    every replica (as after DDP's gradient sync).

    Returns:
        {'cases': [...]} with, per (layout, setup), the number of param elements on this rank that
        differ from the expected value and the expected sum of |update|.
    """
    cases = []
    for tp, ep, etp in layout_list:
        with parallel_layout(tp, ep, etp) as coords:
            for setup in setups:
                model, optimizer = _build(ctx, tp, SHAPES, EXPERT_NAMES, TP_NAMES, setup)
                for group in optimizer.param_groups:
                    group['lr'] = lr
                local = {
                    k: v.float() for k, v in _local(_logical(seed, tp, ep, etp), *coords).items()
                }
                module = model.module
                for name, value in local.items():
                    getattr(module, name).main_grad.copy_(value.reshape(-1, 1))
                optimizer.step()
                wrong = 0
                for name, value in local.items():
                    got = getattr(module, name).detach().float().reshape(-1)
                    wrong += int((got != -lr * torch.sign(value)).sum())
                cases.append({'layout': [tp, ep, etp], 'setup': setup, 'wrong_elements': wrong})
                del model, optimizer
    return {'cases': cases}
