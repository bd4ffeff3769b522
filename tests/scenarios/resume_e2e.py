"""A resumed run is the run that never stopped: pretrain() saves, exits, and resumes.

``scenario_resume_run`` runs the project's GPT entry point (tests/driver/pretrain_tiny_gpt.py)
through upstream's ``pretrain()`` once, with the command line the test gives: the run that never
stops, the run that saves and exits at ``--exit-interval``, or the run that resumes with
``--load`` (the test launches that one in a world of fresh processes). Besides what
``tests.scenarios.pretrain`` records (every iteration's losses, grad norm, learning rate, loss
scale, bitwise), it records after every real iteration:

- a digest of the model params and one of the optimizer (main params and every state tensor,
  ``step`` included), per rank;
- each param group's ``lr``, ``weight_decay``, ``max_lr`` and ``min_lr`` and the scheduler's
  step count;
- with ``full=True``, the gathered model params in full (for runs whose layout changes between
  save and resume, where digests of per-rank shards cannot be compared).

- every random number stream (Python, NumPy, torch CPU, and each stream of Megatron's RNG
  tracker, per rank) at the start of train(), after the load and the data iterators' build, and
  after every real iteration: a resumed run must go on with the very streams of the run that
  never stopped (on CPU ranks dropout draws from the CPU generator, under a tracker fork from
  the fork's stream, so a stray or wrong state also shows in every later loss).

Test-only shim:

- ``fp32_params``: the params whose names start with this prefix stay fp32 when the model is
  cast to bf16/fp16, as a module that keeps its own params in fp32 does (one group then mixes
  fp32 and bf16 params: change ``distopt-mixed-dtype-group-state``). A LayerNorm's weight and
  bias are such a module on CPU (bf16 input, fp32 affine params).
"""

import contextlib
import functools
import hashlib
import random

import numpy as np
import torch

from tests.scenarios.common import import_with_real_cuda, patched, torch_norm_sequence_parallel
from tests.scenarios.pretrain import _hexes, scenario_pretrain_gpt


def _model_digest(model):
    h = hashlib.sha256()
    for chunk in model:
        for name, param in chunk.named_parameters():
            h.update(name.encode())
            h.update(param.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()[:16]


def _inner_optimizers(optimizer):
    return [opt.optimizer for opt in getattr(optimizer, 'chained_optimizers', None) or [optimizer]]


def _optimizer_digest(optimizer):
    h = hashlib.sha256()
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group['params']:
                h.update(param.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy())
                for key, value in sorted(inner.state.get(param, {}).items()):
                    h.update(key.encode())
                    if isinstance(value, torch.Tensor):
                        flat = value.detach().cpu().reshape(-1).contiguous()
                        h.update(flat.view(torch.uint8).numpy())
                    else:
                        h.update(repr(value).encode())
    return h.hexdigest()[:16]


def _groups(optimizer):
    return [
        {key: _hexes(group.get(key)) for key in ('lr', 'weight_decay', 'max_lr', 'min_lr')}
        for inner in _inner_optimizers(optimizer)
        for group in inner.param_groups
    ]


def _rng():
    """A digest of each random number stream: 'python', 'numpy', 'torch' (the CPU generator,
    which the CPU harness's "device" generator is), and 'tracker:<name>' for every stream of
    Megatron's RNG tracker."""
    from megatron.core import tensor_parallel

    states = {
        'python': repr(random.getstate()).encode(),
        'numpy': repr(np.random.get_state()).encode(),
        'torch': torch.get_rng_state().numpy().tobytes(),
    }
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        states[f'tracker:{name}'] = state.numpy().tobytes()
    return {name: hashlib.sha256(state).hexdigest()[:16] for name, state in states.items()}


def _full_params(model):
    """Every model param as float hex, keyed by name (the same on every DP layout)."""
    return {
        name: _hexes(param) for chunk in model for name, param in sorted(chunk.named_parameters())
    }


@contextlib.contextmanager
def _step_recorder(out, full):
    from megatron.training import training

    original_train, original_log = training.train, training.training_log
    live = {}

    @functools.wraps(original_train)
    def train(forward_step_func, model, optimizer, opt_param_scheduler, *a, **kw):
        live.update(model=model, optimizer=optimizer, scheduler=opt_param_scheduler)
        out['start'] = {'model': _model_digest(model), 'rng': _rng()}
        if full:
            out['start']['params'] = _full_params(model)
        return original_train(forward_step_func, model, optimizer, opt_param_scheduler, *a, **kw)

    @functools.wraps(original_log)
    def training_log(*a, **kw):
        iteration = a[3] if len(a) > 3 else kw['iteration']
        model, optimizer = live['model'], live['optimizer']
        record = {
            'iteration': iteration,
            'model': _model_digest(model),
            'optimizer': _optimizer_digest(optimizer),
            'groups': _groups(optimizer),
            'scheduler_steps': live['scheduler'].num_steps,
            'rng': _rng(),
        }
        if full:
            record['params'] = _full_params(model)
        out['steps'].append(record)
        return original_log(*a, **kw)

    with patched(training, 'train', train), patched(training, 'training_log', training_log):
        yield


@contextlib.contextmanager
def _keep_fp32(prefix):
    """Keep the params whose names (in the unwrapped model) start with ``prefix`` fp32 under
    Float16Module."""
    if not prefix:
        yield
        return
    from megatron.core.transformer import module

    original_init = module.Float16Module.__init__

    @functools.wraps(original_init)
    def __init__(self, config, wrapped, *a, **kw):
        original_init(self, config, wrapped, *a, **kw)
        kept = [p for n, p in self.module.named_parameters() if n.startswith(prefix)]
        assert kept, f'no parameter of the model starts with {prefix!r}'
        for param in kept:
            param.data = param.data.float()

    with patched(module.Float16Module, '__init__', __init__):
        yield


# What "the resumed run is the run that never stopped" compares after every real iteration: the
# log's values, then the recorded param groups, scheduler steps and digests.
ITERATION_KEYS = ('losses', 'grad_norm', 'lr', 'loss_scale')
STEP_KEYS = ('groups', 'scheduler_steps', 'model', 'optimizer', 'rng')


def by_iteration(res):
    """{iteration: the log's values and the step's record} of one rank's scenario_resume_run."""
    steps = {s['iteration']: s for s in res['steps']}
    return {it['iteration']: {**it, **steps[it['iteration']]} for it in res['iterations']}


def scenario_resume_run(ctx, argv, full=False, fp32_params=None):
    """One pretrain() run of the tiny GPT with ``argv``; what it did at every iteration.

    Args:
        argv: the driver's command line (tests.scenarios.pretrain.tiny_gpt_args and more).
        full: also record every model param in full after every iteration.
        fp32_params: name prefix of model params kept fp32 under bf16/fp16 (None: none).

    Returns:
        scenario_pretrain_gpt's record plus 'steps': per real iteration, the digests, groups,
        scheduler steps (and 'params' with ``full``).
    """
    # megatron.training imports GPU-only modules at import time; pretrain's scenario says how.
    import_with_real_cuda('megatron.training.training')
    out = {'steps': [], 'start': None}
    # The local spec's torch LayerNorm refuses sequence parallelism (MoE at TP > 1 needs it).
    sp = '--sequence-parallel' in argv
    norm = torch_norm_sequence_parallel() if sp else contextlib.nullcontext()
    with _keep_fp32(fp32_params), _step_recorder(out, full), norm:
        result = scenario_pretrain_gpt(ctx, argv)
    result['steps'], result['start'] = out['steps'], out['start']
    return result
