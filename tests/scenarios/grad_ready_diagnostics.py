"""Scenarios: a DDP parameter that never reports a grad with overlap_grad_reduce (patch 0007).

With overlap_grad_reduce=True, megatron DDP dispatches a bucket group's reduce once every param in
it has registered its grad as ready (as often as in the first, calibration, batch). A param that
requires grad but receives none never registers, so the bucket's reduce is never dispatched:
- unused from the start: the calibration check in ``_ParamAndGradBucketGroup.reset()`` (run by the
  next ``zero_grad_buffer()``) fails with a bare ``AssertionError``;
- used in the calibration batch and not later (a skipped branch, or ``requires_grad`` turned off
  after wrapping): ``finish_grad_sync`` fails with "Communication call has not been issued for
  this bucket (k/n params have grad available)".
Neither names the param. The scenarios drive the real DDP wrapper, the real no-pipelining schedule,
``finalize_model_grads`` and ``get_megatron_optimizer`` (bf16 or fp32, with or without the
distributed optimizer) and return what was raised, where, and the DDP's view of the bucket groups.
"""

import contextlib

import torch

from tests.scenarios.common import (
    FFN,
    HIDDEN,
    OUT,
    _forward_step,
    build_optimizer,
    make_config,
    rank_iterator,
    wrap_ddp,
)

# Modes: what happens to the ``branch`` layer (and which params never report).
#   'unused'         branch is defined but never used in forward.
#   'skip_later'     branch is used in the calibration step (0) and skipped from step 1 on.
#   'freeze_later'   branch.weight.requires_grad = False after step 0 (bias still trains).
#   'expert_unused'  branch carries allreduce=False (expert bucket group); its bias is never
#                    used (a bucket group in which no param at all reports stays in calibration
#                    and is reduced synchronously, which works, so one param must report).
#   'undercount'     the calibration step runs with a no_sync_func that syncs anyway (a no-op
#                    context: every microbatch registers), later steps with DDP's no_sync: every
#                    param reports, but fewer times than calibrated. (Without any no_sync_func
#                    the schedule tells DDP, and patch 0013 recalibrates; a no-op one it cannot
#                    tell from DDP's.)
#   'none'           branch always used: the reference, must train.
MODES = ('unused', 'skip_later', 'freeze_later', 'expert_unused', 'undercount', 'none')


class _Net(torch.nn.Module):
    def __init__(self, expert_branch):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.branch = torch.nn.Linear(FFN, FFN)
        self.head = torch.nn.Linear(FFN, OUT)
        self.use_branch = True
        self.use_branch_bias = True
        if expert_branch:
            for param in self.branch.parameters():
                param.allreduce = False

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.use_branch:
            bias = self.branch.bias if self.use_branch_bias else None
            h = h + torch.tanh(torch.nn.functional.linear(h, self.branch.weight, bias))
        return self.head(h)


def _build(ctx, mode, dtype, distopt, bucket_size):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    config = make_config(dtype)

    class _Model(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.net = _Net(expert_branch=mode == 'expert_unused')

        def set_input_tensor(self, input_tensor):
            pass

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(1234)
    model = _Model().to(ctx.device)
    if mode == 'unused':
        model.net.use_branch = False
    if mode == 'expert_unused':
        model.net.use_branch_bias = False
    ddp = wrap_ddp(model, config, overlap=True, distopt=distopt, bucket_size=bucket_size)
    optimizer = build_optimizer(ddp, dtype=dtype, distopt=distopt)
    # The DDP callbacks alone (megatron.training, whose install_train_loop_hooks() sets the same,
    # is not imported by these core-only scenarios).
    config.no_sync_func = ddp.no_sync
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None
    return config, model, ddp, optimizer


def _groups(ddp):
    return ddp.bucket_groups + ddp.expert_parallel_bucket_groups


def _drain(ddp):
    for group in _groups(ddp):
        if group.grad_reduce_handle is not None:
            group.grad_reduce_handle.wait()
            group.grad_reduce_handle = None


def _train(ctx, config, model, ddp, optimizer, mode, steps, microbatches, out):
    """Run ``steps`` steps through the no-pipelining schedule, applying ``mode``'s change at
    step 1; the first error ends the run and is recorded in ``out`` with its phase and step."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = parallel_state.get_data_parallel_rank()
    if mode == 'undercount':
        config.no_sync_func = contextlib.nullcontext
    for step in range(steps):
        if step == 1 and mode == 'undercount':
            config.no_sync_func = ddp.no_sync
        if step == 1 and mode == 'skip_later':
            model.net.use_branch = False
        if step == 1 and mode == 'freeze_later':
            model.net.branch.weight.requires_grad_(False)
        phase = 'zero_grad_buffer'
        try:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            phase = 'forward_backward'
            get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=rank_iterator(1234, step, microbatches, dp_rank, ctx.device),
                model=[ddp],
                num_microbatches=microbatches,
                seq_length=1,
                micro_batch_size=4,
                forward_only=False,
            )
            phase = 'optimizer'
            _, grad_norm, _ = optimizer.step()
        except Exception as exc:  # noqa: BLE001 - the error is the result
            out.update(error=f'{type(exc).__name__}: {exc}', phase=phase, step=step)
            _drain(ddp)
            break
        out['grad_norms'].append(float(grad_norm))
    return out


def scenario_missing_grad(
    ctx, mode, dtype='fp32', distopt=True, steps=3, microbatches=2, bucket_size=None
):
    """Train ``steps`` steps with ``mode`` applied to the branch layer; report the first error.

    Args:
        mode: one of MODES.
        dtype: 'fp32' or 'bf16'.
        distopt: use the distributed optimizer (reduce-scatter) or not (all-reduce).
        steps: training steps.
        microbatches: microbatches per step (all but the last under no_sync).
        bucket_size: DDP bucket size in elements (None: one bucket per buffer).

    Returns:
        dict: 'error' ('<Type>: <message>' or None), 'phase' ('zero_grad_buffer', 'forward_backward'
        or 'optimizer') and 'step' of the error, 'grad_norms' of the steps that finished, and
        'groups' (per bucket group: number of params and their names in DDP order).
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    config, model, ddp, optimizer = _build(ctx, mode, dtype, distopt, bucket_size)
    names = {p: n for n, p in model.named_parameters()}
    out = {'error': None, 'phase': None, 'step': None, 'grad_norms': []}
    out['groups'] = [sorted(names[p] for p in g.params) for g in _groups(ddp)]
    return _train(ctx, config, model, ddp, optimizer, mode, steps, microbatches, out)


# A bucket group of several buckets: DDP with disable_bucketing=True puts every bucket of every
# buffer into one bucket group (partition_buckets, case 1), and a model whose params have two
# dtypes has two buffers (grouped by param dtype), so that group holds two buckets: the fp32 one
# (fc1, head: the first param's dtype comes first) and the bf16 one (the branch). The branch has
# more params than the message lists (grad_ready_diagnostics._MAX_LISTED).
WIDE_BRANCH_LAYERS = 6


class _WideNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.branch = torch.nn.ModuleList(
            torch.nn.Linear(FFN, FFN) for _ in range(WIDE_BRANCH_LAYERS)
        ).to(torch.bfloat16)
        self.head = torch.nn.Linear(FFN, OUT)
        self.use_branch = True

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.use_branch:
            b = h.to(torch.bfloat16)
            for layer in self.branch:
                b = torch.tanh(layer(b))
            h = h + b.float()
        return self.head(h)


def scenario_wide_group(ctx, mode, steps=2, microbatches=2):
    """A bucket group of two buckets (fp32, bf16), silent params in the second one.

    Args:
        mode: 'skip_later' (the branch's 12 params stop reporting from step 1), 'undercount'
            (calibration step with a no-op no_sync_func, as in scenario_missing_grad) or 'none'.
        steps: training steps.
        microbatches: microbatches per step.

    Returns:
        dict: as scenario_missing_grad, with 'buckets' (per bucket group, per bucket: the param
        names in the bucket's order, the order the message lists them in) and 'shapes' (per
        param name).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    parallel_state.initialize_model_parallel()
    config = make_config('fp32')

    class _Model(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.net = _WideNet()

        def set_input_tensor(self, input_tensor):
            pass

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(1234)
    model = _Model().to(ctx.device)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=None
    )
    ddp = DistributedDataParallel(
        config=config, ddp_config=ddp_config, module=model, disable_bucketing=True
    )
    optimizer = build_optimizer(ddp, dtype='fp32', distopt=True)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None

    names = {p: n for n, p in model.named_parameters()}
    out = {'error': None, 'phase': None, 'step': None, 'grad_norms': []}
    out['buckets'] = [
        [[names[p] for p in bucket.params_list] for bucket in group.buckets]
        for group in _groups(ddp)
    ]
    out['shapes'] = {n: list(p.shape) for n, p in model.named_parameters()}
    return _train(ctx, config, model, ddp, optimizer, mode, steps, microbatches, out)
