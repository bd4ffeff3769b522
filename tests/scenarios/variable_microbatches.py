"""Steps with different microbatch counts under overlap_grad_reduce without no_sync_func (0013).

Library users (RL trainers with dynamic batch sizes) call the real schedule
(``get_forward_backward_func()``) with ``num_microbatches`` that changes from step to step and no
``config.no_sync_func``: every microbatch's backward then registers its grads as ready, so the
grad-ready counts DDP calibrates on the first batch encode that batch's microbatch count. A step
runs here as train_step does: ``zero_grad_buffer()``, ``optimizer.zero_grad()``, one or more
forward_backward calls (``finalize_model_grads`` after the last one, or after each one), then
``optimizer.step()``. Each step records a bitwise digest of the reduced grads (the local shard
under the distributed optimizer), the grad norm, a digest of the params after the step, and how
many bucket groups dispatched their grad reduce during backward (the overlap) rather than in
finish_grad_sync. A reduce in flight completes before the next microbatch's forward (``_settled``),
so pristine's early reduces give the same wrong values on every run.
"""

import hashlib
import random

from tests.scenarios.common import Trainer, _forward_step, init_parallel, rank_iterator


def _groups(model):
    return model.bucket_groups + model.expert_parallel_bucket_groups


def _instrument(model):
    """Count, per step, the bucket groups whose start_grad_sync ran outside finish_grad_sync
    (dispatched by register_grad_ready during backward: the overlap)."""
    state = {'in_finish': 0, 'early': set()}
    for group in _groups(model):
        start, finish = group.start_grad_sync, group.finish_grad_sync

        def start_grad_sync(*args, _group=group, _start=start, **kwargs):
            if not state['in_finish']:
                state['early'].add(id(_group))
            return _start(*args, **kwargs)

        def finish_grad_sync(*args, _finish=finish, **kwargs):
            state['in_finish'] += 1
            try:
                return _finish(*args, **kwargs)
            finally:
                state['in_finish'] -= 1

        group.start_grad_sync = start_grad_sync
        group.finish_grad_sync = finish_grad_sync
    return state


def _grad_digest(model, rank, world):
    """sha256 of the reduced grads: the whole buffer, or this rank's shard under distopt (of the
    distributed-optimizer instance's DP group when there are several instances)."""
    if model.ddp_config.num_distributed_optimizer_instances > 1:
        rank, world = model.intra_dp_cp_group.rank(), model.intra_dp_cp_group.size()
    h = hashlib.sha256()
    for buffer in model.buffers + model.expert_parallel_buffers:
        for bucket in buffer.buckets:
            grad = bucket.grad_data.view(-1)
            if model.ddp_config.use_distributed_optimizer:
                grad = grad.chunk(world)[rank]
            h.update(grad.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _params_digest(trainer):
    h = hashlib.sha256(trainer.params().numpy().tobytes())
    return h.hexdigest()[:16]


def _drain(model):
    """Wait on grad reduces a failed step left in flight, so the world stays in step."""
    for group in _groups(model):
        if group.grad_reduce_handle is not None:
            group.grad_reduce_handle.wait()
            group.grad_reduce_handle = None


def _settled(forward_step_func, chunks):
    """``forward_step_func`` that first waits on grad reduces in flight (the handles stay), so a
    reduce dispatched early (pristine, more microbatches than calibrated) completes before the
    next microbatch's grads land: its wrong result is deterministic instead of a race."""

    def forward_step(data_iterator, model):
        for chunk in chunks:
            for group in _groups(chunk):
                if group.grad_reduce_handle is not None:
                    group.grad_reduce_handle.wait()
        return forward_step_func(data_iterator, model)

    return forward_step


def _step(trainer, step, calls, finalize_each_call, reset_at=()):
    """One optimizer step over ``calls`` (microbatch counts of its forward_backward calls);
    ``reset_at``: [step, call] pairs before which DDP's reset_grad_ready_calibration() runs
    (call 0: before the step's first call; call > 0: between two calls of the step)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, config = trainer.model, trainer.config
    model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    for index, num_microbatches in enumerate(calls):
        if [step, index] in reset_at:
            model.reset_grad_ready_calibration()
        last = index == len(calls) - 1
        config.finalize_model_grads_func = (
            finalize_model_grads if (last or finalize_each_call) else None
        )
        data = rank_iterator(
            trainer.seed,
            step * 16 + index,
            num_microbatches,
            trainer.dp_rank,
            trainer.ctx.device,
            trainer.micro_batch_size,
        )
        get_forward_backward_func()(
            forward_step_func=_settled(_forward_step, [model]),
            data_iterator=data,
            model=[model],
            num_microbatches=num_microbatches,
            seq_length=1,
            micro_batch_size=trainer.micro_batch_size,
            forward_only=False,
        )
    grads = _grad_digest(model, trainer.ctx.rank, trainer.ctx.world_size)
    ok, grad_norm, _ = trainer.optimizer.step()
    return grads, grad_norm


def run_sequence(
    ctx,
    steps,
    overlap=True,
    distopt=False,
    no_sync=False,
    no_sync_from_step=None,
    finalize_each_call=False,
    bucket_size=100,
    seed=1234,
    reset_at=(),
    instances=1,
):
    """Train ``steps`` (each an int: one forward_backward call, or a list: one call per count).

    ``no_sync_from_step``: install no_sync_func from that step on (steps before it run without,
    as a warm-up before train() installs its hooks). ``reset_at``: see _step. ``instances``:
    DDP's num_distributed_optimizer_instances (the world must be initialised with as many).

    Returns:
        dict: per step ``grads`` (digest), ``grad_norm`` (float hex), ``params`` (digest),
        ``early`` (bucket groups that dispatched during backward), ``groups`` (their number);
        ``error`` (type: message) and ``failed_step`` where a step raised.
    """
    trainer = Trainer(
        ctx,
        overlap=overlap,
        distopt=distopt,
        bucket_size=bucket_size,
        seed=seed,
        install_hooks=False,
        ddp_kwargs=dict(num_distributed_optimizer_instances=instances) if instances > 1 else None,
    )
    trainer.install_hooks(no_sync=no_sync and not no_sync_from_step, finalize=True)
    state = _instrument(trainer.model)
    out = {'grads': [], 'grad_norm': [], 'params': [], 'early': []}
    out['groups'] = len(_groups(trainer.model))
    for step, calls in enumerate(steps):
        if no_sync_from_step and step == no_sync_from_step:
            trainer.install_hooks(no_sync=True, finalize=True)  # as train() after a warm-up
        calls = calls if isinstance(calls, list) else [calls]
        state['early'] = set()
        try:
            grads, grad_norm = _step(trainer, step, calls, finalize_each_call, reset_at)
        except Exception as exc:  # noqa: BLE001 (recorded: the counterfactual's result)
            _drain(trainer.model)
            out['error'] = f'{type(exc).__name__}: {exc}'
            out['failed_step'] = step
            break
        out['grads'].append(grads)
        out['grad_norm'].append(None if grad_norm is None else float(grad_norm).hex())
        out['params'].append(_params_digest(trainer))
        out.setdefault('_params', []).append(trainer.params())
        out['early'].append(len(state['early']))
    return out


def _compare(fork, ref):
    """Drop the param vectors; add the largest param difference per step against ``ref``."""
    fork_params, ref_params = fork.pop('_params', []), ref.pop('_params', [])
    fork['max_param_diff'] = [(a - b).abs().max().item() for a, b in zip(fork_params, ref_params)]
    return fork


def scenario_sequence(ctx, steps, **kwargs):
    """One sequence with overlap_grad_reduce, and the same with overlap_grad_reduce=False."""
    instances = kwargs.get('instances', 1)
    if instances > 1:
        init_parallel(num_distributed_optimizer_instances=instances)
    else:
        init_parallel()
    ref = run_sequence(ctx, steps, overlap=False, **kwargs)
    return {
        'overlap': _compare(run_sequence(ctx, steps, overlap=True, **kwargs), ref),
        'reference': ref,
    }


def random_sequences(seed, count, max_steps=6, max_microbatches=6, multi_call=False):
    """Seeded random microbatch-count sequences; runs of equal counts are likely."""
    rng = random.Random(seed)
    sequences = []
    for _ in range(count):
        steps, current = [], rng.randint(1, max_microbatches)
        for _ in range(rng.randint(3, max_steps)):
            if rng.random() < 0.5:
                current = rng.randint(1, max_microbatches)
            if multi_call and rng.random() < 0.3:
                steps.append([rng.randint(1, 3) for _ in range(rng.randint(2, 3))])
            else:
                steps.append(current)
        sequences.append(steps)
    return sequences


def scenario_property(
    ctx, seed, count, distopt_values=(False, True), bucket_sizes=(None, 100), **kwargs
):
    """``count`` seeded random sequences, each with and without the distributed optimizer; for
    each, whether overlap equals the overlap_grad_reduce=False reference bitwise, per step, and
    where the count did not change from the previous step whether every group overlapped.
    bucket_size None (one bucket per buffer, as overlap_grad_reduce=False builds) makes the
    layouts equal, so grads and params compare bitwise; with small buckets the distributed
    optimizer's shards differ from the reference's and only values compare."""
    init_parallel()
    results = []
    for steps in random_sequences(seed, count, **kwargs):
        for distopt in distopt_values:
            for bucket_size in bucket_sizes:
                ref = run_sequence(ctx, steps, overlap=False, distopt=distopt)
                fork = run_sequence(
                    ctx, steps, overlap=True, distopt=distopt, bucket_size=bucket_size
                )
                results.append(
                    {
                        'steps': steps,
                        'distopt': distopt,
                        'bucket_size': bucket_size,
                        'overlap': _compare(fork, ref),
                        'reference': ref,
                    }
                )
    return results


def _pp_device_rng(scenario):
    from tests.scenarios import warmup as W

    return W._device_rng(scenario)


def _run_pp(ctx, steps, overlap, vpp):
    """``steps`` (one forward_backward call each) through the pipeline schedules on
    warmup_pp's stage model (dense and expert params), finalize_model_grads, no no_sync_func."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tests.scenarios import warmup as W
    from tests.scenarios import warmup_pp as P

    trainer = P.PPTrainer(ctx, 'fp32', overlap, False, 1, vpp)
    trainer.config.finalize_model_grads_func = finalize_model_grads
    W._seed_all()
    groups = [g for chunk in trainer.model for g in _groups(chunk)]
    states = [_instrument(chunk) for chunk in trainer.model]
    out = {'grads': [], 'params': [], 'early': [], 'groups': len(groups)}
    for step, num_microbatches in enumerate(steps):
        for state in states:
            state['early'] = set()
        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        data = trainer.iterators(
            lambda: P._batches(10_000 + 97 * step, ctx.device, trainer.dp_rank, num_microbatches)
        )
        try:
            get_forward_backward_func()(
                forward_step_func=_settled(P._forward_step, trainer.model),
                data_iterator=data,
                model=trainer.model,
                num_microbatches=num_microbatches,
                seq_length=1,
                micro_batch_size=P.MBS,
                forward_only=False,
            )
        except Exception as exc:  # noqa: BLE001 (recorded: the counterfactual's result)
            for chunk in trainer.model:
                _drain(chunk)
            out['error'], out['failed_step'] = f'{type(exc).__name__}: {exc}', step
            break
        h = hashlib.sha256()
        for chunk in trainer.model:
            h.update(_grad_digest(chunk, 0, 1).encode())
        out['grads'].append(h.hexdigest()[:16])
        trainer.optimizer.step()
        out['params'].append(trainer.digests()['params'])
        out['early'].append(sum(len(state['early']) for state in states))
    return out


@_pp_device_rng
def scenario_pipeline(ctx, sequences, pp=2, vpp=1):
    """Pipeline schedules (1F1B, or interleaved with vpp > 1): each microbatch-count sequence
    with overlap_grad_reduce and with overlap_grad_reduce=False, same layout."""
    from tests.scenarios import warmup_pp as P

    results = []
    for steps in sequences:
        arms = {}
        for overlap in (True, False):
            layout = P._layout(ctx, pp, 1, vpp)
            arms[overlap] = _run_pp(ctx, steps, overlap, vpp)
        results.append(
            {'steps': steps, 'layout': layout, 'overlap': arms[True], 'reference': arms[False]}
        )
    return results
