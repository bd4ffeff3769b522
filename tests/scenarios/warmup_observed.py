"""What train() does with and without ``--warmup-train-steps``, observed from outside.

Runs a GPT entry point (the project's driver, or upstream's ``pretrain_gpt.py``) through the real
``pretrain()`` and ``train()`` (tests/scenarios/pretrain.py's scenario_pretrain_gpt) and records,
without touching any helper of megatron/training/warmup.py:

- at every ``train_step`` call (warmup steps and real steps, told apart by the warmup having
  returned or not) and at the end of ``train()``: the model config's callbacks, each as "which
  bound method of which object" (``model[0].start_grad_sync``, ``optimizer.scale_loss``) or the
  function's qualified name, or None; and whether the DDP forward pre-hooks are registered;
- every step's reduced loss (float hex) and, after every real step, a bitwise digest of every
  module buffer (the MoE router's ``expert_bias`` and ``local_tokens_per_expert`` among them);
- the values training_log printed per iteration (losses, aux losses, MTP losses);
- the rerun state machine after ``train()`` (what a checkpoint saves of it).

Options, each test-only and applied around the unmodified script:

- ``finalize_hook``: the model's own ``finalize_model_grads_func`` (a wrapper of
  ``finalize_model_grads``) is on the model config when setup_model_and_optimizer() returns, as a
  builder that installs its own hook leaves it before train().
- ``packed_stats``: the forward step accounts every micro-batch as packed (two sequences of half the
  sequence length) through upstream's ``update_seqlen_stats_from_cu_seqlens``, as pretrain_gpt's
  forward step does for packed (THD) batches; train() reads those statistics back per iteration
  for the FLOPs it counts (recorded per ``num_floating_point_operations`` call).
- ``batches``: every real batch comes from the warmup's own synthetic generator
  (``warmup.synthetic_gpt_batches``, the same stream on every rank), so the warmup's steps can be
  compared with real steps (fork only).
"""

import contextlib
import functools
import hashlib
import io
import re

import torch

from tests.scenarios.common import patched
from tests.scenarios.pretrain import scenario_pretrain_gpt
from tests.scenarios.warmup import _import_training

CALLBACKS = (
    'no_sync_func',
    'grad_sync_func',
    'param_sync_func',
    'finalize_model_grads_func',
    'grad_scale_func',
)


def builder_finalize_model_grads(*args, **kwargs):
    """A builder's own finalize hook (wraps upstream's finalize_model_grads)."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(*args, **kwargs)


def _describe(fn, model, optimizer):
    """'model[i].name' / 'optimizer.name' / 'module.qualname' / None, lists element-wise."""
    if fn is None:
        return None
    if isinstance(fn, (list, tuple)):
        return [_describe(f, model, optimizer) for f in fn]
    if isinstance(fn, functools.partial):
        return f'partial({_describe(fn.func, model, optimizer)})'
    owner = getattr(fn, '__self__', None)
    if owner is not None and hasattr(fn, '__func__'):
        where = next((f'model[{i}]' for i, m in enumerate(model) if m is owner), None)
        if where is None:
            where = 'optimizer' if owner is optimizer else type(owner).__name__
        return f'{where}.{fn.__func__.__name__}'
    return f'{getattr(fn, "__module__", "?")}.{getattr(fn, "__qualname__", repr(fn))}'


def _installed(config, model, optimizer):
    out = {name: _describe(getattr(config, name, None), model, optimizer) for name in CALLBACKS}
    out['forward_pre_hooks'] = [
        bool(getattr(m, 'remove_forward_pre_hook_handles', None)) for m in model
    ]
    return out


def _hex(value):
    if isinstance(value, torch.Tensor):
        return [float(x).hex() for x in value.detach().float().reshape(-1).tolist()]
    return float(value).hex()


def _buffers(model):
    """Bitwise digest per module buffer (DDP shadows Module.buffers(), so use the Module method)."""
    out = {}
    for i, chunk in enumerate(model):
        for name, buf in torch.nn.Module.named_buffers(chunk):
            t = buf.detach().cpu().reshape(-1).contiguous()
            h = hashlib.sha256(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b'')
            out[f'{i}:{name}'] = h.hexdigest()[:16]
    return out


def _rerun_state():
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    return {
        'current_iteration': machine.current_iteration,
        'state': str(machine.state),
        'first_iteration_complete': getattr(machine, 'first_iteration_complete', None),
        'large_value_counts': dict(getattr(machine, 'large_value_counts', {}) or {}),
        'max_values': {
            k: float(v).hex() for k, v in (getattr(machine, 'max_values', {}) or {}).items()
        },
    }


_SKIP_KEYS = ('elapsed time', 'throughput', 'learning rate', 'global batch size', 'number of')


def _printed(text):
    """{iteration: {key: printed value}} from training_log's lines (losses and aux losses)."""
    out = {}
    for m in re.finditer(r' iteration +(\d+)/ *\d+ \|(.*)', text):
        fields = {}
        for part in m.group(2).split('|'):
            if ':' in part:
                key, value = part.rsplit(':', 1)
                key = key.strip()
                if not key.startswith(_SKIP_KEYS):
                    fields[key] = value.strip()
        out[int(m.group(1))] = fields
    return out


def _step_observer(out, state, original_step):
    """train_step, recording per call its kind, the installed set-up, loss and buffers."""

    @functools.wraps(original_step)
    def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, *a, **kw):
        kind = 'warmup' if state['in_warmup'] else 'real'
        record = {'kind': kind, 'installed': _installed(config, model, optimizer)}
        record['rerun_before'] = _rerun_state()
        result = original_step(
            forward_step_func, data_iterator, model, optimizer, scheduler, config, *a, **kw
        )
        record['loss'] = {k: _hex(v) for k, v in sorted(result[0].items())}
        record['skipped'] = int(result[1])
        if kind == 'real':
            record['buffers'] = _buffers(model)
        out['steps'].append(record)
        return result

    return train_step


def _packed_forward(counted, args):
    """The forward step counting each micro-batch as packed (THD) sequences, as pretrain_gpt's."""
    from megatron.training import training

    @functools.wraps(counted)
    def forward_step_func(data_iterator, model_chunk, *fa, **fkw):
        # As pretrain_gpt's forward step does for a packed (THD) micro-batch: two
        # sequences of seq_length / 2 real tokens.
        half = args.seq_length // 2
        cu_seqlens = torch.tensor([0, half, 2 * half], dtype=torch.int32)
        training.update_seqlen_stats_from_cu_seqlens(cu_seqlens)
        return counted(data_iterator, model_chunk, *fa, **fkw)

    return forward_step_func


def _train_observer(out, original_train, batches, packed_stats):
    """train, recording the buffers before and the set-up, rerun state and buffers after."""

    @functools.wraps(original_train)
    def train(forward_step_func, model, optimizer, scheduler, train_data_iterator, *a, **kw):
        from megatron.core.rerun_state_machine import RerunDataIterator
        from megatron.core.utils import get_model_config
        from megatron.training.global_vars import get_args

        args = get_args()
        if batches:
            # The real batches are the warmup's own synthetic stream (same seed, every rank), so
            # warmup step k and real step k of a run without warmup see the same batch.
            from megatron.training.warmup import synthetic_gpt_batches

            train_data_iterator = RerunDataIterator(synthetic_gpt_batches(args))
        if packed_stats:
            forward_step_func = _packed_forward(forward_step_func, args)

        out['buffers_before'] = _buffers(model)
        result = original_train(
            forward_step_func, model, optimizer, scheduler, train_data_iterator, *a, **kw
        )
        out['end'] = _installed(get_model_config(model[0]), model, optimizer)
        out['rerun'] = _rerun_state()
        out['buffers_end'] = _buffers(model)
        return result

    return train


def _flops_observer(out, original_flops):
    """num_floating_point_operations, recording each value."""

    @functools.wraps(original_flops)
    def num_floating_point_operations(*a, **kw):
        value = original_flops(*a, **kw)
        out['flops'].append(_hex(value))
        return value

    return num_floating_point_operations


def _setup_observer(original_setup, finalize_hook):
    """setup_model_and_optimizer, putting the builder's finalize hook on with ``finalize_hook``."""

    @functools.wraps(original_setup)
    def setup_model_and_optimizer(*a, **kw):
        model, optimizer, scheduler = original_setup(*a, **kw)
        if finalize_hook:
            from megatron.core.utils import get_model_config

            get_model_config(model[0]).finalize_model_grads_func = builder_finalize_model_grads
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def _warmup_marker(state, original_run):
    """run_warmup, marking the time inside it (train_step calls then are warmup steps)."""

    @functools.wraps(original_run)
    def run_warmup(*a, **kw):
        state['in_warmup'] = True
        try:
            return original_run(*a, **kw)
        finally:
            state['in_warmup'] = False

    return run_warmup


@contextlib.contextmanager
def _observers(out, finalize_hook, batches, packed_stats):
    from megatron.training import training

    state = {'in_warmup': False, 'train_depth': 0}
    original_step, original_train = training.train_step, training.train
    original_setup = training.setup_model_and_optimizer
    train_step = _step_observer(out, state, original_step)
    train = _train_observer(out, original_train, batches, packed_stats)
    original_flops = training.num_floating_point_operations
    num_floating_point_operations = _flops_observer(out, original_flops)
    setup_model_and_optimizer = _setup_observer(original_setup, finalize_hook)

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(training, 'train_step', train_step))
        stack.enter_context(patched(training, 'train', train))
        stack.enter_context(
            patched(training, 'setup_model_and_optimizer', setup_model_and_optimizer)
        )
        stack.enter_context(
            patched(training, 'num_floating_point_operations', num_floating_point_operations)
        )
        if hasattr(training, 'run_warmup'):
            run_warmup = _warmup_marker(state, training.run_warmup)
            stack.enter_context(patched(training, 'run_warmup', run_warmup))
        yield


def scenario_observe(
    ctx, argv, driver='tiny_gpt', tag=None, finalize_hook=False, batches=False, packed_stats=False
):
    """Run pretrain_gpt.py with ``argv`` and report what train() installed and did (see above).

    Returns:
        {'steps': [per train_step call: kind, installed, loss, skipped, buffers (real steps)],
        'end': installed after train(), 'rerun': the rerun state machine after train(),
        'printed': {iteration: training_log's printed values}, 'buffers_before'/'buffers_end',
        'exit', 'error' (the pretrain scenario's own), 'iterations' (its per-iteration record)}.
    """
    _import_training()  # with the real torch.cuda bound, as the pretrain scenario does
    out = {'steps': [], 'flops': []}
    text = io.StringIO()
    with _observers(out, finalize_hook, batches, packed_stats), contextlib.redirect_stdout(text):
        res = scenario_pretrain_gpt(ctx, argv, driver=driver, tag=tag)
    out.update(
        exit=res.get('exit'),
        argparse_error=res.get('argparse_error'),
        iterations=res.get('iterations'),
        warmup_calls=res.get('warmup_calls'),
        warmup_log=res.get('warmup_log'),
        printed=_printed(text.getvalue()),
    )
    return out


def results_of(handle):
    """Every rank's result of a launched world, each checked for an error and its exit status."""

    per_rank = handle.result()
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
        assert res['exit'] in (None, 0), f'rank {rank}: exit {res["exit"]}'
    return per_rank
