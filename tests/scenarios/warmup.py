"""Scenarios for the pre-training warmup (megatron/training/warmup.py, patch 0004).

Real steps go through megatron.training.training.train_step (the real function, with Megatron's
global args, timers, num-microbatches calculator and an OptimizerParamScheduler set up here), with
the model-config callbacks and forward pre-hook handling that train() applies before its loop.
Warmup steps run at the pretrain() boundary, i.e. before those callbacks exist.

Arms:
    naive: the warmup most projects bolt on: train_step on synthetic data with the config as the
        boundary leaves it (optionally with finalize_model_grads installed), no restore. Works on
        any tree and reproduces the upstream DDP assertions at the first real step.
    fork: megatron.training.warmup.run_warmup, called as train() calls it: right after
        install_train_loop_hooks(), with train_step and the param_sync_func that set-up held back;
        the real steps then run under the same set-up. Path 'train': exactly train()'s call (the
        step count from the args, the default synthetic GPT batches); path 'run_warmup': with an
        explicit step count, data iterator and args.
    none: no warmup (the reference for bitwise exactness).
"""

import contextlib
import functools
import hashlib
import inspect
import io
import random
import sys
import types

import numpy as np
import torch

from tests.scenarios.common import (
    Trainer,
    import_with_real_cuda,
    init_parallel,
    install_train_loop_hooks,
)
from tests.scenarios.common import patched as _patched

MBS = 4


def _import_training():
    """Import megatron.training.training with the real torch.cuda module bound."""
    import_with_real_cuda('megatron.training.training')


def _device_rng(scenario):
    """Run ``scenario`` with a stand-in device RNG on CPU ranks.

    The warmup snapshots the device RNG through tensor_parallel/random.py's helpers, as pretrain()
    on a GPU would; the CPU redirect's pretrain mode provides that RNG (on GPUs: a no-op).
    """

    @functools.wraps(scenario)
    def wrapper(ctx, **kwargs):
        from tests.harness import cpu_redirect

        if not cpu_redirect.installed():
            return scenario(ctx, **kwargs)
        with cpu_redirect.pretrain_mode():
            return scenario(ctx, **kwargs)

    return wrapper


def _set_global_args(trainer, accumulation, overlap_param_gather=False):
    """Megatron global args/timers/microbatch calculator as pretrain() would leave them."""
    _import_training()
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    with _patched(sys, 'argv', ['warmup-scenario']):
        args = parse_args(ignore_unknown_args=True)
    ddp = trainer.model.ddp_config
    args.micro_batch_size = MBS
    args.data_parallel_size = trainer.dp_size
    args.global_batch_size = MBS * trainer.dp_size * accumulation
    args.seq_length = 1
    args.use_distributed_optimizer = ddp.use_distributed_optimizer
    args.overlap_grad_reduce = ddp.overlap_grad_reduce
    args.overlap_param_gather = overlap_param_gather
    args.iteration = 0
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    args.num_floating_point_operations_so_far = 0
    args.pipeline_model_parallel_size = 1
    args.virtual_pipeline_model_parallel_size = None
    args.skip_train = False
    args.perform_rl_step = False
    args.use_megatron_fsdp = False
    args.seed = 1234
    args.gtp_weight_remat_size = getattr(args, 'gtp_weight_remat_size', None) or 1
    args.timing_log_level = 2  # real timers for everything train_step times
    global_vars.set_args(args)
    global_vars._GLOBAL_TIMERS = None
    global_vars._set_timers(args)
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(
        trainer.ctx.rank, None, args.global_batch_size, MBS, trainer.dp_size
    )
    return args


def _scheduler(trainer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        trainer.optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=4 * MBS * trainer.dp_size,
        lr_decay_steps=40 * MBS * trainer.dp_size,
        lr_decay_style='cosine',
        start_wd=0.01,
        end_wd=0.05,
        wd_incr_steps=40 * MBS * trainer.dp_size,
        wd_incr_style='linear',
    )


def _loss_func(y, output):
    loss = torch.nn.functional.mse_loss(output.float(), y)
    return loss, {'loss': loss.detach().clone()}


def _xy(batch, hidden=8, out=4):
    """(x, y) of a batch; the warmup's default synthetic GPT batches (dicts of token ids) map to
    one-hot rows."""
    if not isinstance(batch, dict):
        return batch
    one_hot = torch.nn.functional.one_hot
    x = one_hot(batch['tokens'][:, 0] % hidden, hidden).float() * 3
    return x, one_hot(batch['labels'][:, 0] % out, out).float()


def _forward_step(data_iterator, model):
    """Forward step that consumes python, numpy and torch RNG (like dropout / noise sampling)."""
    x, y = _xy(next(data_iterator))
    x, y = x.to(next(model.parameters()).device), y.to(next(model.parameters()).device)
    noise = torch.randn(x.shape) * 1e-2 + (random.random() - 0.5) * 1e-3
    noise = noise + float(np.random.rand()) * 1e-3
    x = x + noise.to(x.device)
    return model(x), lambda output: _loss_func(y, output)


def _real_iterator(trainer, step, accumulation):
    g = torch.Generator().manual_seed(10_000 + 97 * step + trainer.dp_rank)
    for _ in range(accumulation):
        x = torch.randn(MBS, 8, generator=g)
        y = torch.randn(MBS, 4, generator=g)
        yield x.to(trainer.ctx.device), y.to(trainer.ctx.device)


def _as_train_step_takes(iterator):
    from megatron.core.rerun_state_machine import RerunDataIterator

    return RerunDataIterator(iterator)


def _synthetic_iterator(device):
    g = torch.Generator().manual_seed(777)
    while True:
        yield (torch.randn(MBS, 8, generator=g) * 3).to(device), torch.randn(
            MBS, 4, generator=g
        ).to(device)


def _seed_all(seed=5):
    """Seed python, numpy and torch: the forward step draws from all three."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _sha(h, tensor):
    t = tensor.detach().cpu().reshape(-1).contiguous()
    h.update(str((t.dtype, tuple(t.shape))).encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b'')


def _optimizers(optimizer):
    return list(getattr(optimizer, 'chained_optimizers', None) or [optimizer])


def _digests(trainer, scheduler, args):
    """Bitwise digests of params, main params + optimizer state, scheduler, RNG, counters."""
    out = {}
    h = hashlib.sha256()
    for _, p in trainer.model.named_parameters():
        _sha(h, p)
    out['params'] = h.hexdigest()[:16]
    h = hashlib.sha256()
    for opt in _optimizers(trainer.optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            h.update(repr(sorted((k, v) for k, v in group.items() if k != 'params')).encode())
            for p in group['params']:
                _sha(h, p)
                state = inner.state.get(p, {})
                if all(isinstance(v, torch.Tensor) and not v.any() for v in state.values()):
                    state = {}  # Adam's fresh state (zero moments, step 0) reads as absent
                for key, value in sorted(state.items()):
                    h.update(key.encode())
                    if isinstance(value, torch.Tensor):
                        _sha(h, value)
                    else:
                        h.update(repr(value).encode())
    out['optimizer'] = h.hexdigest()[:16]
    out['scheduler'] = repr(sorted(scheduler.state_dict().items()))
    out['lr_wd'] = [
        (g['lr'], g['weight_decay'])
        for o in _optimizers(trainer.optimizer)
        for g in o.optimizer.param_groups
    ]
    h = hashlib.sha256()
    _sha(h, torch.get_rng_state())
    h.update(repr(random.getstate()).encode())
    h.update(np.random.get_state()[1].tobytes())
    out['rng'] = h.hexdigest()[:16]
    out['counters'] = [args.iteration, args.consumed_train_samples, args.skipped_train_samples]
    h = hashlib.sha256()
    for buffer in trainer.model.buffers + trainer.model.expert_parallel_buffers:
        _sha(h, buffer.grad_data)
    out['grad_buffers'] = h.hexdigest()[:16]
    scalers = []
    for opt in _optimizers(trainer.optimizer):
        scaler = getattr(opt, 'grad_scaler', None)
        if scaler is not None:
            scalers.append(
                {
                    k: float(v) if isinstance(v, torch.Tensor) else v
                    for k, v in sorted(scaler.state_dict().items())
                }
            )
    out['scaler'] = scalers
    out['training_flags'] = [
        name for name, m in trainer.model.named_modules() if not m.training
    ]  # modules in eval mode
    out['silenced_args'] = [getattr(args, name, None) for name in _SILENCED]
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    out['rerun'] = [machine.current_iteration, str(machine.state)]
    return out


# train_step()'s per-iteration dump options (the warmup switches them off while it runs).
_SILENCED = (
    'save_params_interval',
    'save_activations_interval',
    'save_tokens_per_expert_interval',
    'save_wgrads_interval',
    'save_dgrads_interval',
)


_CONFIG_CALLBACKS = (
    'no_sync_func',
    'grad_sync_func',
    'param_sync_func',
    'finalize_model_grads_func',
    'grad_scale_func',
)


def _callbacks(config):
    return {n: getattr(config, n) is not None for n in _CONFIG_CALLBACKS}


def _calibration(trainer):
    """Each DDP bucket group's grad-ready calibration: (first batch?, golden counts)."""
    return [
        (group.is_first_batch, sorted(group.golden_per_param_grad_ready_counts.values()))
        for group in trainer.model.bucket_groups + trainer.model.expert_parallel_bucket_groups
    ]


def _hooks(trainer):
    return len(trainer.model.remove_forward_pre_hook_handles) > 0


class _RealRun:
    """train()'s set-up and loop around the real train_step (callbacks, pre-hook toggling).

    ``warmup(param_sync_func)``, if given, runs right after the set-up, where train() calls
    run_warmup(); the real steps then run under the same set-up.
    """

    def __init__(self, trainer, scheduler, args, accumulation, first_step=0, warmup=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.training import training

        self.t, self.s, self.args, self.acc = trainer, scheduler, args, accumulation
        config, model = trainer.config, trainer.model
        self.param_sync_func = install_train_loop_hooks([model], trainer.optimizer, config, args)
        self.pending = training.should_disable_forward_pre_hook(args)
        self.warmup = warmup(self.param_sync_func) if warmup is not None else None
        self.fb = get_forward_backward_func()
        self.step_index = first_step

    def leave(self):
        """Undo train()'s set-up, as a run saved to and resumed from a checkpoint starts."""
        for name in _CONFIG_CALLBACKS:
            setattr(self.t.config, name, None)
        if self.pending:
            self.t.model.enable_forward_pre_hook()
            self.pending = False
        self.t.model.zero_grad_buffer()  # a resumed run's grad buffers start at zero

    def step(self):
        from megatron.training import training

        out = training.train_step(
            _forward_step,
            _real_iterator(self.t, self.step_index, self.acc),
            [self.t.model],
            self.t.optimizer,
            self.s,
            self.t.config,
            self.fb,
            iteration=self.args.iteration,
        )
        if self.pending and not out[1]:
            self.t.model.enable_forward_pre_hook()
            self.t.config.param_sync_func = self.param_sync_func
            self.pending = False
        self.args.iteration += 1
        self.args.consumed_train_samples += MBS * self.t.dp_size * self.acc
        self.step_index += 1
        return float(out[0]['loss']), None if out[5] is None else float(out[5])


def _run_warmup(trainer, scheduler, param_sync_func, *steps, forward_step=_forward_step, **kw):
    """run_warmup() over the trainer's model where train() calls it; ``steps`` and ``kw``
    (data_iterator, args) are what a direct call passes besides."""
    from megatron.training import training
    from megatron.training.warmup import run_warmup

    return run_warmup(
        training.train_step,
        forward_step,
        [trainer.model],
        trainer.optimizer,
        scheduler,
        trainer.config,
        param_sync_func,
        *steps,
        **kw,
    )


def _direct_warmup(ctx, trainer, scheduler, args, param_sync_func, steps):
    """A direct run_warmup() call: ``steps`` steps on synthetic batches."""
    data = _as_train_step_takes(_synthetic_iterator(ctx.device))
    return _run_warmup(trainer, scheduler, param_sync_func, steps, data_iterator=data, args=args)


def _naive_warmup(trainer, scheduler, args, steps, finalize):
    """train_step at the boundary with no callbacks (and no restore)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training import training

    if finalize:
        trainer.config.finalize_model_grads_func = finalize_model_grads
    data = _synthetic_iterator(trainer.ctx.device)
    for _ in range(steps):
        training.train_step(
            _forward_step,
            data,
            [trainer.model],
            trainer.optimizer,
            scheduler,
            trainer.config,
            get_forward_backward_func(),
            iteration=0,
        )
    trainer.config.finalize_model_grads_func = None


def _fresh_state_kept(trainer, states_before):
    """On a fresh run (no optimizer state before the warmup): every state entry the warmup left
    is allocated and zero (None when the run was resumed)."""
    if states_before:
        return None
    states = [s for o in _optimizers(trainer.optimizer) for s in o.optimizer.state.values()]
    return bool(states) and all(not v.any() for s in states for v in s.values())


def _adam_steps(trainer):
    """The most optimizer steps any param has taken (torch Adam's per-param 'step'; 0 without
    state)."""
    steps = [
        float(state['step'])
        for opt in _optimizers(trainer.optimizer)
        for state in opt.optimizer.state.values()
        if 'step' in state
    ]
    return max(steps, default=0.0)


def _record_optimizer_state(trainer, res):
    """Record, right before the warmup's restore, the optimizer steps taken so far: the warmup's
    steps reached the optimizer step only if they grew."""
    from megatron.training import state_snapshot

    original = state_snapshot.TrainingStateSnapshot.restore

    def restore(self, *a, **kw):
        res['adam_steps_before_restore'] = _adam_steps(trainer)
        return original(self, *a, **kw)

    return _patched(state_snapshot.TrainingStateSnapshot, 'restore', restore)


def _record_loss_scales(trainer, res):
    """Record the loss scale each warmup step runs at (read as train_step starts)."""
    from megatron.training import training

    original = training.train_step
    res['warmup_loss_scales'] = []

    def train_step(*a, **kw):
        res['warmup_loss_scales'].append(float(trainer.optimizer.get_loss_scale()))
        return original(*a, **kw)

    return _patched(training, 'train_step', train_step)


def _fake_clock(step_seconds):
    """A stand-in for warmup._now under which warmup step k takes step_seconds[k] seconds."""
    ends = [sum(step_seconds[: k + 1]) for k in range(len(step_seconds))]
    ticks = iter([t for k, end in enumerate(ends) for t in ((ends[k - 1] if k else 0.0), end)])
    return lambda: next(ticks)


def _build(ctx, dtype, overlap, distopt, accumulation, overlap_param_gather=False, opt_kwargs=None):
    from megatron.core import rerun_state_machine

    rerun_state_machine.destroy_rerun_state_machine()  # each arm counts its own iterations
    rerun_state_machine.initialize_rerun_state_machine()
    trainer = Trainer(
        ctx,
        dtype=dtype,
        overlap=overlap,
        distopt=distopt,
        install_hooks=False,
        ddp_kwargs={'overlap_param_gather': overlap_param_gather} if overlap_param_gather else None,
        opt_kwargs=opt_kwargs,
    )
    trainer.config.grad_scale_func = None  # as get_model() leaves it; train() installs it
    scheduler = _scheduler(trainer)
    args = _set_global_args(trainer, accumulation, overlap_param_gather)
    return trainer, scheduler, args


@_device_rng
def scenario_end_to_end(
    ctx, arm, accumulation, warmup_steps=2, real_steps=3, finalize=False, step_seconds=None
):
    """Warmup (arm 'naive' or 'fork') at the boundary, then real steps; returns losses or error.
    ``step_seconds``: the time each warmup step reads (a fake clock for the report's one-time
    cost)."""
    init_parallel()
    trainer, scheduler, args = _build(ctx, 'bf16', True, True, accumulation)
    _seed_all()  # _forward_step draws python/numpy/torch noise: same losses on every run
    out = {'arm': arm, 'accumulation': accumulation, 'losses': [], 'step_error': None}
    if arm == 'naive':
        _naive_warmup(trainer, scheduler, args, warmup_steps, finalize)
    warmup = None
    if arm != 'naive':

        def warmup(param_sync_func):
            buf = io.StringIO()
            clock = contextlib.nullcontext()
            if step_seconds:
                import megatron.training.warmup as warmup_module

                clock = _patched(warmup_module, '_now', _fake_clock(step_seconds))
            with contextlib.redirect_stdout(buf), clock:
                report = _direct_warmup(
                    ctx, trainer, scheduler, args, param_sync_func, warmup_steps
                )
            lines = buf.getvalue().splitlines()
            out['log'] = [line for line in lines if line.startswith('[warmup]')]
            out['groups_reset'] = report.bucket_groups_reset
            out['host_staging_bytes'] = report.host_staging_bytes
            out['step_seconds'] = report.step_seconds
            out['one_time_cost'] = report.one_time_cost
            out['compilations'] = report.compilations
            return report

    run = _RealRun(trainer, scheduler, args, accumulation, warmup=warmup)
    try:
        for _ in range(real_steps):
            out['losses'].append(run.step()[0])
    except Exception as exc:  # noqa: BLE001 - the upstream assertion is the expected outcome
        out['step_error'] = f'{type(exc).__name__}: {exc}'
    return out


def _resume(trainer, scheduler, args, acc, steps):
    """Train ``steps`` real steps, then leave train() as a resumed run starts (see _exact_one)."""
    run = _RealRun(trainer, scheduler, args, acc)
    with contextlib.redirect_stdout(io.StringIO()):
        for _ in range(steps):
            run.step()
    run.leave()


def _arm_start(ctx, combo, acc, dtype, overlap, distopt, opg, opt_kwargs):
    """Build one arm, seed it, then the combo's resume steps and eval-mode submodule."""
    trainer, scheduler, args = _build(ctx, dtype, overlap, distopt, acc, opg, opt_kwargs)
    args.align_param_gather = combo.get('align_param_gather', False)
    _seed_all()
    if combo.get('resume'):
        _resume(trainer, scheduler, args, acc, combo['resume'])
    if combo.get('eval_module'):
        for name, module in trainer.model.named_modules():
            if name.endswith(combo['eval_module']):
                module.eval()
    return trainer, scheduler, args


def _negative_control(combo, arm):
    """The fork arm's negative control of ``combo['break']`` (a no-op context otherwise)."""
    broken = contextlib.nullcontext()
    if arm == 'fork' and combo.get('break') == 'rng':
        # Negative control: skip the RNG restore; the comparison must then detect a change.
        from megatron.training import state_snapshot

        broken = _patched(state_snapshot.TrainingStateSnapshot, '_restore_rng', lambda self: None)
    if arm == 'fork' and combo.get('break') == 'loss_scale':
        from megatron.training import warmup as warmup_module

        broken = _patched(warmup_module, '_hold_loss_scale', lambda optimizer: None)
    return broken


def _start_state(trainer, scheduler, args):
    """The counters and optimizer state an arm starts its warmup (or first real step) with."""
    return {
        'scheduler_num_steps': scheduler.num_steps,
        'optimizer_state': sum(len(o.optimizer.state) for o in _optimizers(trainer.optimizer)),
        'iteration': args.iteration,
        'adam_steps': _adam_steps(trainer),
    }


def _call_warmup(ctx, trainer, scheduler, args, param_sync_func, path, warmup_steps):
    """Run the warmup by ``path``: train()'s own call (steps from the args, GPT batches), or
    run_warmup directly."""
    if path == 'train':  # train()'s own call: steps from the args, GPT batches
        args.warmup_train_steps = warmup_steps
        try:
            return _run_warmup(trainer, scheduler, param_sync_func)
        finally:
            args.warmup_train_steps = 0
    return _direct_warmup(ctx, trainer, scheduler, args, param_sync_func, warmup_steps)


def _record_report(res, report, trainer):
    """What the warmup's report says, and whether a fresh optimizer state stayed fresh."""
    res['host_staging_bytes'] = report.host_staging_bytes
    res['groups_reset'] = report.bucket_groups_reset
    res['calibration_kept'] = report.calibration_kept
    res['skipped_steps'] = report.skipped_steps
    res['fresh_state_kept'] = _fresh_state_kept(trainer, res['start']['optimizer_state'])
    res['warmup_losses'] = [float(x['loss']) for x in report.losses]


def _fork_warmup(ctx, trainer, scheduler, args, res, contexts, path, warmup_steps):
    """The fork arm's warmup hook, recording into ``res`` what the warmup changed and restored.

    ``contexts``: (the negative control, the save_grads recorder), entered around the warmup.
    """
    from megatron.training import global_vars

    broken, recorder = contexts

    def warmup(param_sync_func):
        """Where train() calls run_warmup(): right after install_train_loop_hooks()."""
        timers = global_vars.get_timers()
        elapsed = {n: t.elapsed(reset=False) for n, t in timers.get_all_timers().items()}
        before = _digests(trainer, scheduler, args)
        callbacks_before = {n: getattr(trainer.config, n) for n in _CONFIG_CALLBACKS}
        hooks_before = _hooks(trainer)
        states_seen = _record_optimizer_state(trainer, res)
        scales_seen = _record_loss_scales(trainer, res)
        with contextlib.redirect_stdout(io.StringIO()), broken, recorder, states_seen, scales_seen:
            report = _call_warmup(
                ctx, trainer, scheduler, args, param_sync_func, path, warmup_steps
            )
        _record_report(res, report, trainer)
        after = _digests(trainer, scheduler, args)
        res['after_warmup_equals_before'] = after == before
        res['after_warmup_diff'] = [k for k in before if before[k] != after[k]]
        # The set-up handed back as train() expects it for its first real step.
        res['callbacks_restored'] = all(
            getattr(trainer.config, n) is v for n, v in callbacks_before.items()
        )
        res['hooks_restored'] = _hooks(trainer) == hooks_before
        # Timers train_step touched read as before (none counts warmup time), new ones 0.
        after_timers = {n: t.elapsed(reset=False) for n, t in timers.get_all_timers().items()}
        res['timers_touched'] = sorted(set(after_timers) - set(elapsed))
        res['timers_restored'] = all(
            after_timers[name] == elapsed.get(name, 0.0) for name in after_timers
        )
        return report

    return warmup


def _train_arm(trainer, scheduler, args, acc, warmup, save_grads, real_steps, res, dumps):
    """Enter train() (the warmup hook runs there) and take the real steps; record them."""
    from megatron.training import training

    with contextlib.redirect_stdout(io.StringIO()), _patched(training, 'save_grads', save_grads):
        run = _RealRun(trainer, scheduler, args, acc, args.iteration, warmup)
    res['train_hook_ran'] = getattr(run, 'warmup', None) is not None
    with contextlib.redirect_stdout(io.StringIO()), _patched(training, 'save_grads', save_grads):
        steps = [run.step() for _ in range(real_steps)]
    res['dumps'] = dumps
    res['train_step_restored'] = training.train_step.__name__ == 'train_step'
    res['losses'] = [s[0] for s in steps]
    res['grad_norms'] = [s[1] for s in steps]
    res['final'] = _digests(trainer, scheduler, args)


def _arms_compared(combo, arms):
    """The no-warmup arm against the fork arm: losses, dumps, final digests, bitwise."""
    none, fork = arms['none'], arms['fork']
    return {
        'combo': combo,
        'losses_none': none['losses'],
        'losses_fork': fork['losses'],
        'identical': none['final'] == fork['final']
        and none['losses'] == fork['losses']
        and none['grad_norms'] == fork['grad_norms']
        and none['dumps'] == fork['dumps'],
        'dumps_none': none['dumps'],
        'scaler_none': none['final']['scaler'],
        'diff_keys': [k for k in none['final'] if none['final'][k] != fork['final'][k]],
        'fork': {k: v for k, v in fork.items() if k != 'final'},
    }


def _exact_one(ctx, combo, warmup_steps, real_steps):
    """One combo: warmup arm vs no-warmup arm, bitwise.

    Combo keys besides acc/dtype/overlap/distopt/overlap_param_gather/path:
        resume: N real steps before the warmup (non-zero scheduler num_steps, iteration and
            sample counters, existing optimizer state and a calibrated DDP), as a resumed run.
        eval_module: put this submodule (name suffix) in eval mode before the warmup.
        dumps: --save-params-interval 1 (train_step's dumps are recorded, not written).
        loss_scale_window: fp16 grad scaler growth interval.
        initial_loss_scale: fp16 grad scaler's initial scale (default here 2**12; upstream's
            default, 2**32, overflows every fp16 step until the scaler has backed off).
        align_param_gather: --align-param-gather (with overlap_param_gather: train() holds
            param_sync_func back for the first step, the warmup puts it on after its first).
        break: negative control ('rng': skip the RNG restore; 'loss_scale': the warmup without
            its loss scale hold, as the fork's warmup ran before it had one).
    """
    acc, dtype, overlap, distopt = combo['acc'], combo['dtype'], combo['overlap'], combo['distopt']
    opg = combo.get('overlap_param_gather', False)
    path = combo.get('path', 'run_warmup')
    opt_kwargs = {
        k: combo[k] for k in ('loss_scale_window', 'initial_loss_scale') if k in combo
    } or None
    arms = {}
    _import_training()
    from megatron.training import training

    for arm in ('none', 'fork'):
        trainer, scheduler, args = _arm_start(
            ctx, combo, acc, dtype, overlap, distopt, opg, opt_kwargs
        )
        dumps = []
        if combo.get('dumps'):
            args.save_params_interval = 1

        def save_grads(save_dir, state_dict, iteration, label):
            dumps.append([label, iteration])

        res = {}
        broken = _negative_control(combo, arm)
        res['start'] = _start_state(trainer, scheduler, args)
        recorder = _patched(training, 'save_grads', save_grads)
        warmup = None
        if arm == 'fork':
            contexts = (broken, recorder)
            warmup = _fork_warmup(ctx, trainer, scheduler, args, res, contexts, path, warmup_steps)
        _train_arm(trainer, scheduler, args, acc, warmup, save_grads, real_steps, res, dumps)
        arms[arm] = res
    return _arms_compared(combo, arms)


@_device_rng
def scenario_exactness(ctx, combos, warmup_steps=2, real_steps=3):
    """For each combo: N real steps after warmup+restore vs N steps without warmup, bitwise."""
    results = []
    for combo in combos:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        init_parallel()
        results.append(_exact_one(ctx, combo, warmup_steps, real_steps))
    return {'results': results}


class _Injected(RuntimeError):
    pass


def _failing_drain(*args):
    raise RuntimeError('injected failure while draining collectives')


def _fault_warmup(ctx, trainer, scheduler, args, res, before, fault):
    """The fault arm's warmup hook: a warmup step raises; record what was restored into ``res``.

    ``fault``: (accumulation, fail_step, fail_microbatch, restore_fails) of scenario_fault.
    """
    from megatron.training import state_snapshot

    accumulation, fail_step, fail_microbatch, restore_fails = fault
    calls = {'n': 0}
    synthetic = _as_train_step_takes(_synthetic_iterator(ctx.device))

    def failing(data_iterator, model):
        calls['n'] += 1
        if calls['n'] == fail_step * accumulation + fail_microbatch + 1:
            raise _Injected('injected failure inside a warmup step')
        return _forward_step(data_iterator, model)

    drain = _failing_drain if restore_fails else state_snapshot.reset_ddp_grad_ready_calibration

    def warmup(param_sync_func):  # where train() calls it, after its set-up
        callbacks = {n: getattr(trainer.config, n) for n in _CONFIG_CALLBACKS}
        hooks = _hooks(trainer)
        calibration = _calibration(trainer)
        res['calibrated_before'] = sum(not first for first, _ in calibration)
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                _patched(state_snapshot, 'reset_ddp_grad_ready_calibration', drain),
            ):
                _run_warmup(
                    trainer,
                    scheduler,
                    param_sync_func,
                    3,
                    forward_step=failing,
                    data_iterator=synthetic,
                    args=args,
                )
            res['raised'] = None
        except _Injected as exc:
            res['raised'] = f'{type(exc).__name__}: {exc}'
        res['calls'] = calls['n']
        res['callbacks_restored'] = all(
            getattr(trainer.config, n) is v for n, v in callbacks.items()
        )
        res['hooks_restored'] = _hooks(trainer) == hooks
        res['calibration_restored'] = _calibration(trainer) == calibration
        after = _digests(trainer, scheduler, args)
        res['state_restored'] = after == before
        res['state_diff'] = [k for k in before if before[k] != after[k]]

    return warmup


@_device_rng
def scenario_fault(
    ctx, accumulation=2, fail_step=1, fail_microbatch=1, restore_fails=False, resume=0
):
    """A warmup step raises mid-step: callbacks, hooks and all state are restored, then re-raised.

    Also checks that training after the failure matches training with no warmup, bitwise.
    restore_fails=True also makes the DDP drain of the restore raise: the warmup step's exception
    must still be the one raised, and the host-staged state must still be put back. ``resume``:
    that many real steps first (a resumed run whose DDP real steps calibrated).
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.training import state_snapshot  # noqa: F401 - a base without it fails here

    init_parallel()
    results = {}
    for arm in ('none', 'fault'):
        trainer, scheduler, args = _build(ctx, 'bf16', True, True, accumulation, True)
        _seed_all()
        if resume:
            _resume(trainer, scheduler, args, accumulation, resume)
        sentinel = object()
        trainer.config.finalize_model_grads_func = finalize_model_grads  # a pre-existing value
        before = _digests(trainer, scheduler, args)
        res = {}
        warmup = None
        if arm == 'fault':
            fault = (accumulation, fail_step, fail_microbatch, restore_fails)
            warmup = _fault_warmup(ctx, trainer, scheduler, args, res, before, fault)

        del sentinel
        run = _RealRun(trainer, scheduler, args, accumulation, args.iteration, warmup=warmup)
        with contextlib.redirect_stdout(io.StringIO()):
            res['losses'] = [run.step()[0] for _ in range(3)]
        res['final'] = _digests(trainer, scheduler, args)
        results[arm] = res
    return _fault_against_none(results)


def _argparse_values():
    """--warmup-train-steps for valid and invalid values: the parsed value or the exit."""
    from megatron.training.arguments import parse_args

    parsed = {}
    for value in ('2', '0', '-1', '1.5', 'two'):
        err = io.StringIO()
        try:
            argv = ['pretrain', '--warmup-train-steps', value]
            with _patched(sys, 'argv', argv), contextlib.redirect_stderr(err):
                args = parse_args(ignore_unknown_args=True)
            parsed[value] = {'value': args.warmup_train_steps}
        except SystemExit as exc:
            lines = [l for l in err.getvalue().splitlines() if 'error:' in l]
            parsed[value] = {'exit': exc.code, 'error': lines[-1] if lines else None}
    return parsed


def _unsupported_errors(trainer, args):
    """check_warmup_supported on each unsupported set-up (and a supported one): the errors."""
    from megatron.training.warmup import WarmupUnsupportedError, check_warmup_supported

    model, optimizer, config = [trainer.model], trainer.optimizer, trainer.config
    opt_config = _optimizers(optimizer)[0].config
    errors = {}

    def check(name, args=args, config=config, model=model, optimizer=optimizer):
        try:
            check_warmup_supported(model, optimizer, config, args)
            errors[name] = None
        except WarmupUnsupportedError as exc:
            errors[name] = f'{type(exc).__name__}: {exc}'

    def fake(obj, **overrides):
        return types.SimpleNamespace(**{**vars(obj), **overrides})

    check('pipeline', args=fake(args, pipeline_model_parallel_size=2))
    check('virtual_pipeline', args=fake(args, virtual_pipeline_model_parallel_size=2))
    # The model config says PP 2 while the args say 1: refused all the same.
    check('pipeline_model_config', config=fake(config, pipeline_model_parallel_size=2))
    check(
        'virtual_pipeline_model_config', config=fake(config, virtual_pipeline_model_parallel_size=2)
    )
    check('megatron_fsdp', args=fake(args, use_megatron_fsdp=True))
    check('torch_fsdp2', args=fake(args, use_torch_fsdp2=True))
    check('fp8', config=fake(config, fp8='hybrid', fp8_recipe='delayed'))
    check('fp4', config=fake(config, fp4='nvfp4', fp4_recipe='nvfp4'))
    check('two_chunks', model=[trainer.model, trainer.model])
    check('not_ddp', model=[trainer.model.module])
    check('no_optimizer', optimizer=None)
    # Every optimizer offload flag, whether the args or the optimizer's own config carry it (the
    # chunked flags exist on dev only; on the releases the attribute is set for the test).
    for flag in (
        'optimizer_cpu_offload',
        'chunked_optimizer_state_offload',
        'offload_optimizer_states',
    ):
        check(f'{flag}_args', args=fake(args, **{flag: True}))
        saved = getattr(opt_config, flag, None)
        setattr(opt_config, flag, True)
        try:
            check(f'{flag}_optimizer_config')
        finally:
            setattr(opt_config, flag, saved)
    check('supported')
    return errors


def _bad_num_steps(trainer, scheduler, args, errors):
    """run_warmup with a negative and a fractional number of steps: the errors, into ``errors``."""
    from megatron.training import training
    from megatron.training.warmup import run_warmup

    model, optimizer, config = [trainer.model], trainer.optimizer, trainer.config
    for name, kwargs in {'negative': {'num_steps': -1}, 'float': {'num_steps': 1.5}}.items():
        try:
            run_warmup(
                training.train_step,
                _forward_step,
                model,
                optimizer,
                scheduler,
                config,
                args=args,
                **kwargs,
            )
            errors[name] = None
        except ValueError as exc:
            errors[name] = f'{type(exc).__name__}: {exc}'


@_device_rng
def scenario_bad_input(ctx):
    """Argparse errors for --warmup-train-steps, and clear errors for unsupported combinations."""
    _import_training()
    # First of all: on a base without the warmup, the call fails here.
    from megatron.training import training  # noqa: F401
    from megatron.training.arguments import parse_args
    from megatron.training.warmup import (  # noqa: F401
        WarmupUnsupportedError,
        check_warmup_supported,
        run_warmup,
    )

    _seed_all()
    out = {'argparse': _argparse_values()}
    with _patched(sys, 'argv', ['pretrain']):
        defaults = parse_args(ignore_unknown_args=True)
    out['defaults'] = defaults.warmup_train_steps
    from megatron.training.config import TrainingConfig

    out['config_defaults'] = TrainingConfig().warmup_train_steps

    init_parallel()
    trainer, scheduler, args = _build(ctx, 'fp32', True, True, 1)
    errors = _unsupported_errors(trainer, args)
    _bad_num_steps(trainer, scheduler, args, errors)
    out['errors'] = errors
    out['callbacks_untouched'] = _callbacks(trainer.config)
    return out


@_device_rng
def scenario_layout_from_process_groups(ctx):
    """Process groups at PP 2 while the args and the model config say 1: refused."""
    from megatron.core import parallel_state
    from megatron.training.warmup import WarmupUnsupportedError, check_warmup_supported

    init_parallel()
    trainer, _, args = _build(ctx, 'fp32', True, True, 1)
    parallel_state.destroy_model_parallel()
    init_parallel(pp=2)
    try:
        check_warmup_supported([trainer.model], trainer.optimizer, trainer.config, args)
        return {'error_message': None}
    except WarmupUnsupportedError as exc:
        return {
            'error_message': f'{type(exc).__name__}: {exc}',
            'args_pp': args.pipeline_model_parallel_size,
            'config_pp': trainer.config.pipeline_model_parallel_size,
        }


def scenario_calibration_rule(ctx):
    """warmup._calibration_is_real over the cases that decide it (no process group needed); which
    expert params of a MoE model are reset is warmup._routed_params (tests/test_warmup_pp.py)."""
    from types import SimpleNamespace as NS

    from megatron.training.warmup import _calibration_is_real

    cases = {
        'overlap, no_sync installed, dense': (NS(no_sync_func=print), NS(overlap_grad_reduce=True)),
        'no overlap': (NS(no_sync_func=None), NS(overlap_grad_reduce=False)),
        'overlap, no no_sync_func': (NS(no_sync_func=None), NS(overlap_grad_reduce=True)),
        'overlap, MoE': (NS(no_sync_func=print, num_moe_experts=4), NS(overlap_grad_reduce=True)),
    }
    return {name: _calibration_is_real(*case) for name, case in cases.items()}


def scenario_loss_trackers(ctx):
    """The restore's loss-tracker clean-up (state_snapshot._clear_loss_trackers) on the trackers
    a warmup step fills: MTP's (0.19.2 names its clean-up clean_metrics_in_tracker, 0.18.2
    clean_loss_in_tracker) and the DSA indexer's (clean_loss_in_tracker).
    Returns, per helper, the sum of its tracked values after a step and after the clean-up."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.training import state_snapshot

    one = torch.ones(())
    helpers = {'mtp': MTPLossLoggingHelper}
    try:
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossLoggingHelper,
        )

        helpers['dsa'] = DSAIndexerLossLoggingHelper
    except ImportError:  # a release without DeepSeek sparse attention
        pass
    for name, helper in helpers.items():
        helper.tracker.clear()
        if hasattr(helper, 'save_metrics_to_tracker'):  # MTP on 0.19.2
            helper.save_metrics_to_tracker(one, one, one, 0, 2)
        else:
            helper.save_loss_to_tracker(one, 1, 2)

    def tracked():
        return {
            name: float(sum(v.sum() for v in h.tracker.values() if isinstance(v, torch.Tensor)))
            for name, h in helpers.items()
        }

    out = {'after_step': tracked()}
    state_snapshot._clear_loss_trackers()  # pylint: disable=protected-access
    out['after_clean_up'] = tracked()
    for helper in helpers.values():
        helper.tracker.clear()
    return out


def _fault_against_none(results):
    """The 'fault' arm's result, with whether its training after the restore is bitwise the
    'none' arm's (final digests and losses)."""
    fault = results['fault']
    fault['identical_to_no_warmup'] = (
        fault.pop('final') == results['none']['final']
        and fault['losses'] == results['none']['losses']
    )
    return fault


@_device_rng
def scenario_compilations(ctx, steps=3):
    """The report's ``compilations``: the forward step also runs upstream's ``swiglu`` (a
    ``jit_fuser`` function) on one more row at each call, so dynamo compiles a static graph and
    then a dynamic one during the warmup. Returns the report's count and, as the reference, the
    graphs dynamo holds for ``swiglu`` (none before the warmup: ``torch._dynamo.reset()``)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from megatron.core.fusions import fused_bias_swiglu

    init_parallel()
    trainer, scheduler, args = _build(ctx, 'bf16', True, True, 1)
    torch._dynamo.reset()
    rows = iter(range(5, 100))

    def forward_step(data_iterator, model):
        output, loss_func = _forward_step(data_iterator, model)
        extra = fused_bias_swiglu.swiglu(torch.ones(next(rows), 2, device=output.device))
        return output + 0 * extra.sum(), loss_func

    data = _as_train_step_takes(_synthetic_iterator(ctx.device))
    reports = []

    def warmup(param_sync_func):
        with contextlib.redirect_stdout(io.StringIO()) as buf:
            reports.append(
                _run_warmup(
                    trainer,
                    scheduler,
                    param_sync_func,
                    steps,
                    forward_step=forward_step,
                    data_iterator=data,
                    args=args,
                )
            )
        reports.append(buf.getvalue())

    _RealRun(trainer, scheduler, args, 1, warmup=warmup)  # train()'s set-up, then the warmup
    report, log = reports
    graphs = _debug_get_cache_entry_list(inspect.unwrap(fused_bias_swiglu.swiglu))
    return {
        'compilations': report.compilations,
        'graphs': len(graphs),
        'log': [line for line in log.splitlines() if line.startswith('[warmup] Ran')],
    }
