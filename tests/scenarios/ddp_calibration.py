"""Scenarios for DDP grad-ready calibration (patches 0001 and 0002).

They drive the real megatron-core DistributedDataParallel wrapper and its real bucket groups with
overlap_grad_reduce=True. A "step" is what forward_backward_no_pipelining + finalize_model_grads do
for one batch: zero_grad_buffer(), N microbatches (all but the last under no_sync() when a no_sync
function is installed), then finish_grad_sync(). No optimizer runs, so the weights stay fixed and
grad norms of the same step index are comparable between runs.
"""

import contextlib
import math

import torch

from tests.scenarios.common import make_config


class _TinyNet(torch.nn.Module):
    """Dense layers plus one expert-parallel layer (params with allreduce=False)."""

    def __init__(self, expert: bool):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 4)
        self.expert = torch.nn.Linear(16, 16) if expert else None
        if expert:
            for param in self.expert.parameters():
                param.allreduce = False

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.expert is not None:
            h = h + torch.tanh(self.expert(h))
        return self.out(h)


SEED = 1234


def _build(
    ctx,
    expert=True,
    distopt=False,
    overlap_param_gather=False,
    bucket_size=None,
    fp32_local_accumulation=False,
):
    """The DDP-wrapped _TinyNet (overlap_grad_reduce=True).

    Args:
        fp32_local_accumulation: bf16 params whose grads accumulate locally in separate fp32
            main_grads (param_name_patterns_for_fp32_local_accumulation=('all',)); the grad
            buffer is bf16 and finish_grad_sync copies the reduced grads back into main_grad.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    parallel_state.initialize_model_parallel()
    torch.manual_seed(SEED)
    dtype = torch.bfloat16 if fp32_local_accumulation else torch.float32
    module = _TinyNet(expert).to(device=ctx.device, dtype=dtype)
    config = make_config('bf16' if fp32_local_accumulation else 'fp32', hidden_size=16)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        use_distributed_optimizer=distopt,
        overlap_param_gather=overlap_param_gather,
        bucket_size=bucket_size,
        param_name_patterns_for_fp32_local_accumulation=(
            ('all',) if fp32_local_accumulation else ()
        ),
    )
    return DistributedDataParallel(config, ddp_config, module)


def _groups(ddp):
    return ddp.bucket_groups + ddp.expert_parallel_bucket_groups


def _batch(ctx, step, microbatch, rank=None):
    """A microbatch of ``rank`` (default: this rank), on the CPU when another rank's."""
    rank = ctx.rank if rank is None else rank
    gen = torch.Generator().manual_seed(100000 * (step + 7) + 100 * microbatch + rank)
    x = torch.randn(4, 8, generator=gen)
    y = torch.randn(4, 4, generator=gen)
    return (x.to(ctx.device), y.to(ctx.device)) if rank == ctx.rank else (x, y)


def _local_grad_norm(ctx, step, microbatches, expert=True):
    """Norm of this rank's own, unreduced and unscaled grads of a step (plain torch, no DDP).

    The weights never change in these scenarios, so a fresh net with the same seed reproduces
    them; this is what a DDP step computes when no reduce of its own runs.
    """
    torch.manual_seed(SEED)
    net = _TinyNet(expert).to(ctx.device)
    for mb in range(microbatches):
        x, y = _batch(ctx, step, mb)
        torch.nn.functional.mse_loss(net(x), y).backward()
    total = sum(p.grad.double().pow(2).sum() for p in net.parameters())
    return math.sqrt(float(total))


def _fp64_grads(ctx, step, microbatch, rank):
    """FP64 grads of one microbatch of ``rank`` (the fixed weights in double, plain torch)."""
    torch.manual_seed(SEED)
    net = _TinyNet(True).double()
    x, y = _batch(ctx, step, microbatch, rank)
    torch.nn.functional.mse_loss(net(x.cpu().double()), y.cpu().double()).backward()
    return [p.grad for p in net.parameters()]


def fp64_step_norms(ctx, step, microbatches):
    """FP64 norms of a step's reduced grads on this rank, from every rank's batches.

    Returns:
        {'reduced': the norm of the mean over ranks of each rank's summed microbatch grads (what
        a correct step gives), 'early': the norm of the mean over ranks of microbatch 0's grads
        plus this rank's own later microbatches (what a reduce dispatched after microbatch 0,
        settled before microbatch 1, leaves in the buffer)}.
    """
    per_rank = [
        [_fp64_grads(ctx, step, mb, r) for mb in range(microbatches)] for r in range(ctx.world_size)
    ]
    n = ctx.world_size

    def norm(grads):
        return math.sqrt(float(sum(g.pow(2).sum() for g in grads)))

    reduced = [
        sum(sum(mbs[mb][i] for mb in range(microbatches)) for mbs in per_rank) / n
        for i in range(len(per_rank[0][0]))
    ]
    early = [
        sum(mbs[0][i] for mbs in per_rank) / n
        + sum(per_rank[ctx.rank][mb][i] for mb in range(1, microbatches))
        for i in range(len(per_rank[0][0]))
    ]
    return {'reduced': norm(reduced), 'early': norm(early)}


def _grad_norm(ddp, ctx):
    """Global norm of the reduced grads (only the local shard is reduced under distopt)."""
    total = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    for group in _groups(ddp):
        for bucket in group.buckets:
            grad = bucket.grad_data.view(-1)
            if ddp.ddp_config.use_distributed_optimizer:
                grad = grad.chunk(ctx.world_size)[ctx.rank]
            total += grad.double().pow(2).sum()
    if ddp.ddp_config.use_distributed_optimizer:
        torch.distributed.all_reduce(total)
    return math.sqrt(total.item())


def _step(
    ddp,
    ctx,
    step,
    microbatches=2,
    no_sync=True,
    finish=True,
    extra_backward=False,
    force=False,
    settle=False,
    pre_backwards=0,
):
    """Run one batch; returns the global grad norm after finish_grad_sync (None if not finished).

    Args:
        extra_backward: after the last microbatch, run a second backward through out.weight only,
            so that param registers twice per batch (a legitimate golden count of 2).
        pre_backwards: in the last microbatch, run this many backwards through out.weight only
            before the loss backward (out.weight registers 1 + pre_backwards times, the other
            params once).
        force: set ddp.force_all_reduce for this batch.
        settle: after each microbatch, wait on grad reduces already in flight (handles are kept),
            so a reduce dispatched early always completes before the next microbatch's grads
            land; this makes the early-dispatch result deterministic instead of a race.
    """
    ddp.force_all_reduce = force
    ddp.zero_grad_buffer()
    for mb in range(microbatches):
        last = mb == microbatches - 1
        sync_ctx = ddp.no_sync() if (no_sync and not last) else contextlib.nullcontext()
        with sync_ctx:
            x, y = _batch(ctx, step, mb)
            if last:
                for _ in range(pre_backwards):
                    (ddp.module.out.weight.float().pow(2).sum() * 1e-2).backward()
            out = ddp(x.to(ddp.module.out.weight.dtype)).float()
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            if extra_backward and last:
                (ddp.module.out.weight.pow(2).sum() * 1e-2).backward()
        if settle:
            for group in _groups(ddp):
                if group.grad_reduce_handle is not None:
                    group.grad_reduce_handle.wait()
    if not finish:
        return None
    ddp.finish_grad_sync(force_all_reduce=force)
    ddp.force_all_reduce = False
    return _grad_norm(ddp, ctx)


def _state(group):
    return {
        'is_first_batch': group.is_first_batch,
        'golden': sorted(group.golden_per_param_grad_ready_counts.values()),
        'counts': sorted(group.per_param_grad_ready_counts.values()),
        'is_last_microbatch': group.is_last_microbatch,
        'handle_outstanding': group.grad_reduce_handle is not None,
        'param_gather_dispatched': group.param_gather_dispatched,
        'param_gather_outstanding': group.param_gather_handle is not None,
        'grad_reduce_finished': group.grad_reduce_finished,
    }


def _drain(ddp):
    """Wait on whatever grad reduce a failed step left in flight (works on any tree)."""
    for group in _groups(ddp):
        if group.grad_reduce_handle is not None:
            group.grad_reduce_handle.wait()
            group.grad_reduce_handle = None


def scenario_reset_restores_calibration(ctx, bucket_size=None):
    """Calibrate, train a step, reset: every group (dense and expert) is back to constructor state.

    A second reset inside a no_sync() window checks is_last_microbatch is re-armed, and the next
    step recalibrates to the same golden counts. A reset with keep_golden_counts=True in between
    keeps those counts, and the step after it runs on them without recalibrating; then the
    options recalibrate_params and keep_bucket_groups pick the groups that reset.
    """
    ddp = _build(ctx, bucket_size=bucket_size)
    norms = [_step(ddp, ctx, 0), _step(ddp, ctx, 1)]
    before = [_state(g) for g in _groups(ddp)]
    result = ddp.reset_grad_ready_calibration()
    after = [_state(g) for g in _groups(ddp)]
    norms.append(_step(ddp, ctx, 2))
    norms.append(_step(ddp, ctx, 3))
    recalibrated = [_state(g) for g in _groups(ddp)]
    kept_result = [g.reset_grad_ready_calibration(keep_golden_counts=True) for g in _groups(ddp)]
    kept = [_state(g) for g in _groups(ddp)]
    norms.append(_step(ddp, ctx, 4))
    after_kept_step = [_state(g) for g in _groups(ddp)]
    # The options that pick bucket groups: keep all but the first group's counts, then reset all
    # but the last group's (is_first_batch after each; the groups are calibrated by now).
    first_param = next(iter(_groups(ddp)[0].params))
    ddp.reset_grad_ready_calibration(True, recalibrate_params=[first_param])
    recalibrate_params = [g.is_first_batch for g in _groups(ddp)]
    ddp.reset_grad_ready_calibration(keep_bucket_groups=[_groups(ddp)[-1]])
    keep_bucket_groups = [g.is_first_batch for g in _groups(ddp)]
    with ddp.no_sync():
        in_no_sync = ddp.reset_grad_ready_calibration()
        last_mb_after_reset = [g.is_last_microbatch for g in _groups(ddp)]
    return {
        'num_dense_groups': len(ddp.bucket_groups),
        'num_expert_groups': len(ddp.expert_parallel_bucket_groups),
        'num_params': [len(g.params) for g in _groups(ddp)],
        'result': list(result),
        'result_types': [type(v).__name__ for v in result],
        'before': before,
        'after': after,
        'recalibrated': recalibrated,
        'kept_result': kept_result,
        'kept': kept,
        'after_kept_step': after_kept_step,
        'recalibrate_params': recalibrate_params,
        'keep_bucket_groups': keep_bucket_groups,
        'in_no_sync_result': list(in_no_sync),
        'last_mb_after_reset': last_mb_after_reset,
        'norms': norms,
    }


def scenario_reset_drains_outstanding(ctx, reference=False, bucket_size=None):
    """A step that never calls finish_grad_sync leaves every group's grad reduce in flight.

    Uses the distributed optimizer layout with overlap_param_gather, so the real forward pre-hook
    has set param_gather_dispatched. reset_grad_ready_calibration must wait on and clear each
    handle and restore param_gather_dispatched / grad_reduce_finished; the following step then
    recalibrates and trains. reference=True runs the same step indices without the unfinished step.
    """
    return _reset_between_steps(
        ctx, lambda ddp: _step(ddp, ctx, 1, finish=False), (2, 3), reference, bucket_size
    )


def _reset_between_steps(ctx, disrupt, later_steps, reference, bucket_size):
    """Step 0, then (unless ``reference``) ``disrupt(ddp)`` and reset_grad_ready_calibration
    with every group's state before and after it, then the steps ``later_steps``; the distributed
    optimizer layout with overlap_param_gather."""
    ddp = _build(ctx, distopt=True, overlap_param_gather=True, bucket_size=bucket_size)
    norms = [_step(ddp, ctx, 0)]
    out = {'num_groups': len(_groups(ddp))}
    if not reference:
        disrupt(ddp)
        out['before'] = [_state(g) for g in _groups(ddp)]
        out['result'] = list(ddp.reset_grad_ready_calibration())
        out['after'] = [_state(g) for g in _groups(ddp)]
    norms.extend(_step(ddp, ctx, step) for step in later_steps)
    out['norms'] = norms
    out['golden_after'] = [
        sorted(g.golden_per_param_grad_ready_counts.values()) for g in _groups(ddp)
    ]
    return out


def scenario_overcount(ctx, later_no_sync=False, microbatches=2, settle=True):
    """Calibrate with no_sync (golden 1 per param), then run step 1 with or without no_sync.

    Without no_sync every microbatch registers, the counts match golden after microbatch 1 and the
    reduce is dispatched before accumulation is done. Returns the step-1 grad norm, or what it
    raised (under 'raised').
    settle=False leaves the early reduce racing with the next microbatch (norm varies run to run).
    """
    ddp = _build(ctx)
    calib = _step(ddp, ctx, 0, microbatches=microbatches)
    golden = [sorted(g.golden_per_param_grad_ready_counts.values()) for g in _groups(ddp)]
    out = {'calibration_norm': calib, 'raised': None, 'norm': None}
    try:
        out['norm'] = _step(
            ddp, ctx, 1, microbatches=microbatches, no_sync=later_no_sync, settle=settle
        )
    except Exception as exc:  # noqa: BLE001 - the fork's guard is the expected outcome
        out['raised'] = f'{type(exc).__name__}: {exc}'
        _drain(ddp)
    out['golden'] = [sorted(g.golden_per_param_grad_ready_counts.values()) for g in _groups(ddp)]
    out['golden_at_step1'] = golden
    out['fp64'] = fp64_step_norms(ctx, 1, microbatches)
    return out


def scenario_naive_warmup(
    ctx, warmup_steps=1, warmup_finish=True, reset=True, steps=2, microbatches=2
):
    """Warm-up steps without no_sync (golden = microbatches), then real steps with no_sync.

    reset=True calls model.reset_grad_ready_calibration() between them (AttributeError on a tree
    without it). warmup_steps=0 is the reference run. Returns the real steps' grad norms and,
    under 'local_norms', the norms of this rank's unreduced local grads of the same steps.
    """
    ddp = _build(ctx)
    for i in range(warmup_steps):
        # settle: a warm-up reduce left in flight has completed before the next step zeroes and
        # refills the grad buffer (otherwise what the next step reads depends on timing).
        _step(
            ddp,
            ctx,
            50 + i,
            microbatches=microbatches,
            no_sync=False,
            finish=warmup_finish,
            settle=True,
        )
    out = {'golden_after_warmup': None, 'reset': None}
    if warmup_steps:
        # Golden is frozen by the zero_grad_buffer() of the step after the first batch.
        out['state_after_warmup'] = [_state(g) for g in _groups(ddp)]
    if reset:
        out['reset'] = list(ddp.reset_grad_ready_calibration())
    out['norms'] = [_step(ddp, ctx, s, microbatches=microbatches) for s in range(steps)]
    out['golden'] = [sorted(g.golden_per_param_grad_ready_counts.values()) for g in _groups(ddp)]
    out['local_norms'] = [_local_grad_norm(ctx, s, microbatches) for s in range(steps)]
    return out


def scenario_legit_registrations(ctx, steps=3):
    """Legitimate patterns the overcount guard must accept.

    out.weight registers twice in the last microbatch (second backward), so its golden count is 2;
    step 2 runs with force_all_reduce. Returns norms and golden counts.
    """
    ddp = _build(ctx)
    norms = []
    for s in range(steps):
        norms.append(_step(ddp, ctx, s, extra_backward=True, force=(s == 2)))
    golden = [sorted(g.golden_per_param_grad_ready_counts.values()) for g in _groups(ddp)]
    return {'norms': norms, 'golden': golden}


def scenario_reset_drains_param_gather(ctx, reference=False, bucket_size=None):
    """Reset while every group's param all-gather is in flight (distributed optimizer layout).

    After a step, ddp.start_param_sync() dispatches the asynchronous all-gathers that the
    training loop issues after optimizer.step() with overlap_param_gather; the next forward's
    pre-hooks would wait on them. reset_grad_ready_calibration must complete them first (it sets
    param_gather_dispatched=False, so the next forward dispatches again). reference=True runs
    the same step indices without the all-gather and the reset.
    """
    return _reset_between_steps(
        ctx, lambda ddp: ddp.start_param_sync(), (1, 2), reference, bucket_size
    )


def _main_grads(ddp):
    """Float64 copy of every param's main_grad (the tensor the optimizer reads)."""
    return torch.cat([p.main_grad.detach().double().reshape(-1) for p in ddp.module.parameters()])


def scenario_reset_drain_copies_back(ctx, reference=False):
    """bf16 params with fp32 local grad accumulation: a drained reduce lands in main_grad.

    Calibrate, then run step 1 without finish_grad_sync (its reduce of the bf16 buffer is in
    flight) and reset: main_grad must hold the reduced grads, exactly as finish_grad_sync would
    have left them (reference=True finishes step 1 instead). Later steps recalibrate.
    """
    ddp = _build(ctx, fp32_local_accumulation=True)
    params = list(ddp.module.parameters())
    out = {
        'extra_main_grads': sum(
            getattr(p, 'main_grad_copy_in_grad_buffer', None) is not None for p in params
        ),
        'main_grad_dtypes': sorted({str(p.main_grad.dtype) for p in params}),
        'num_params': len(params),
    }
    norms = [_step(ddp, ctx, 0)]
    local = None
    if reference:
        norms.append(_step(ddp, ctx, 1))
    else:
        _step(ddp, ctx, 1, finish=False)
        local = _main_grads(ddp)
        out['result'] = list(ddp.reset_grad_ready_calibration())
    main = _main_grads(ddp)
    buffer = torch.cat([p.main_grad_copy_in_grad_buffer.double().reshape(-1) for p in params])
    out['main_grads'] = main.tolist()
    out['main_grad_equals_buffer'] = bool(torch.equal(main, buffer))
    out['main_grad_changed_by_reset'] = None if local is None else not torch.equal(main, local)
    norms.append(_step(ddp, ctx, 2))
    out['norms'] = norms
    return out


def scenario_guard_boundary(ctx, golden=1, registrations=2):
    """out.weight registers ``registrations`` times in a batch calibrated at ``golden``.

    The extra registrations come from backwards through out.weight alone before the loss
    backward of the last microbatch, so the other params of its bucket group have not registered
    yet and no reduce is in flight: only the count can tell. Returns the step-1 grad norm or what
    it raised.
    """
    ddp = _build(ctx)
    calib = _step(ddp, ctx, 0, pre_backwards=golden - 1)
    out = {'calibration_norm': calib, 'raised': None, 'norm': None}
    try:
        out['norm'] = _step(ddp, ctx, 1, pre_backwards=registrations - 1)
    except Exception as exc:  # noqa: BLE001 - the guard (fork) or the late assert (pristine)
        out['raised'] = f'{type(exc).__name__}: {exc}'
        _drain(ddp)
    # Frozen by step 1's zero_grad_buffer().
    out['golden'] = [sorted(g.golden_per_param_grad_ready_counts.values()) for g in _groups(ddp)]
    return out
