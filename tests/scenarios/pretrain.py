"""Scenarios that train a GPT through the real ``megatron.training.pretrain()``.

Two entry points (``driver``), both run unmodified as ``__main__`` inside a harness world (CPU
ranks with gloo or GPUs with NCCL):

- ``'tiny_gpt'`` (default): the project's own ``tests/driver/pretrain_tiny_gpt.py``, written from
  ``megatron.core``'s public API. It needs nothing but the installed tree, so the pretrain-level
  tests run on any machine.
- ``'pretrain_gpt'``: upstream's own ``pretrain_gpt.py`` with ``model_provider.py`` and
  ``gpt_builders.py``, read at test time from the Megatron-LM clone that ``FORK_MEGATRON_LM`` names
  (a work tree or a bare repository), at the ref of the selected base; never committed here. The
  optional ``megatron-lm`` tier (tests/harness/tiers.py): without the variable those tests skip.

What the scenario adds around either script, all test-only and each listed in
tests/harness/README.md:

- ``initialize_megatron(allow_no_cuda=True)`` on CPU ranks (upstream's own CPU switch; pretrain()
  passes nothing, so ``assert torch.cuda.is_available()`` would stop it first).
- ``compile_helpers()``: upstream runs ``make`` in ``megatron/core/datasets``, which has no Makefile
  in the wheels nor in the materialized tree. The scenario compiles that tree's ``helpers.cpp``
  once into ``build/helpers-cache/`` and registers it as ``megatron.core.datasets.helpers_cpp``.
- Recorders: ``training.training_log`` and ``training.train`` are wrapped (the originals run)
  to record every real iteration's losses, grad norm, learning rate and loss scale bitwise, and
  a digest of the model and optimizer after the last iteration. ``warmup.run_warmup`` is wrapped
  on the fork to record its calls: step count, whether train() was running, how many real
  train_step calls had run and whether train()'s interval timer existed yet.
- On the fork, ``warmup_expert_gemms.PREWARM_DEVICES`` with 'cpu' on CPU ranks: the routed-expert
  GEMM shapes after the warmup steps run there as on a GPU.
"""

import contextlib
import functools
import hashlib
import importlib.util
import io
import os
import re
import runpy
import subprocess
import sys
import sysconfig
import tempfile

import torch

from tests.scenarios.common import import_with_real_cuda, patched

DRIVERS = ('tiny_gpt', 'pretrain_gpt')
UPSTREAM_FILES = ('pretrain_gpt.py', 'model_provider.py', 'gpt_builders.py')
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_GPT = os.path.join(REPO, 'tests', 'driver', 'pretrain_tiny_gpt.py')


def driver_script_name(driver):
    """The file name argparse reports as the program (``prog``) of ``driver``."""
    return 'pretrain_tiny_gpt.py' if driver == 'tiny_gpt' else 'pretrain_gpt.py'


def driver_params():
    """The drivers as pytest params: upstream's skips in the 'megatron-lm' tier without a clone."""
    import pytest

    from tests.harness import tiers

    return [
        pytest.param('tiny_gpt', id='tiny_gpt'),
        pytest.param(
            'pretrain_gpt',
            id='pretrain_gpt',
            marks=tiers.skipif(
                not os.environ.get('FORK_MEGATRON_LM'),
                'megatron-lm',
                "upstream's pretrain_gpt.py: FORK_MEGATRON_LM is not set",
            ),
        ),
    ]


def drivers_here():
    """The drivers this machine can run (the registered calls of a test module)."""
    return DRIVERS if os.environ.get('FORK_MEGATRON_LM') else DRIVERS[:1]


def read_upstream_file(path, ref):
    """Text of ``path`` at ``ref`` in the Megatron-LM clone of ``FORK_MEGATRON_LM``.

    Raises:
        RuntimeError: naming the clone and the file when either is missing.
    """
    clone = os.environ.get('FORK_MEGATRON_LM')
    if not clone:
        raise RuntimeError('FORK_MEGATRON_LM is not set (the megatron-lm tier needs a clone)')
    proc = subprocess.run(
        ['git', '-C', clone, 'show', f'{ref}:{path}'], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f'FORK_MEGATRON_LM={clone} has no {path} at {ref}: fetch that ref there '
            f'({proc.stderr.strip()})'
        )
    return proc.stdout


def tiny_gpt_args(world_size, train_iters=4, dtype='bf16', distopt=True, overlap=True):
    """Command line of a tiny local-spec GPT on mock data (2 layers, hidden 64, seq 32).

    Args:
        world_size: data-parallel size (TP = PP = 1).
        train_iters: real iterations.
        dtype: 'bf16', 'fp16' or 'fp32'.
        distopt: --use-distributed-optimizer.
        overlap: --overlap-grad-reduce.
    """
    mbs, accumulation = 2, 2
    args = [
        '--num-layers', '2',
        '--hidden-size', '64',
        '--ffn-hidden-size', '128',
        '--num-attention-heads', '4',
        '--seq-length', '32',
        '--max-position-embeddings', '32',
        '--micro-batch-size', str(mbs),
        '--global-batch-size', str(mbs * accumulation * world_size),
        '--train-iters', str(train_iters),
        '--lr', '1e-3',
        '--min-lr', '1e-4',
        '--lr-decay-style', 'cosine',
        '--lr-warmup-iters', '2',
        '--weight-decay', '0.01',
        '--clip-grad', '1.0',
        '--seed', '1234',
        '--mock-data',
        '--tokenizer-type', 'NullTokenizer',
        '--vocab-size', '127',
        '--split', '100,0,0',
        '--num-workers', '0',
        '--eval-iters', '0',
        '--eval-interval', '1000000',
        '--log-interval', '1',
        '--transformer-impl', 'local',
        '--no-gradient-accumulation-fusion',
        '--no-masked-softmax-fusion',
        '--no-bias-gelu-fusion',
        '--no-bias-dropout-fusion',
        '--no-persist-layer-norm',
        '--use-cpu-initialization',
        '--distributed-backend', 'gloo' if not torch.cuda.is_available() else 'nccl',
    ]  # fmt: skip
    if dtype == 'bf16':
        args.append('--bf16')
    elif dtype == 'fp16':
        args += ['--fp16', '--initial-loss-scale', '4096']
    if distopt:
        args.append('--use-distributed-optimizer')
    if overlap:
        args.append('--overlap-grad-reduce')
    return args


# ------------------------------------------------------------------------------------------------
# Test-only shims (CPU ranks) and recorders.


def _helpers_cache_dir(tree_path):
    source = os.path.join(tree_path, 'megatron', 'core', 'datasets', 'helpers.cpp')
    with open(source, 'rb') as f:
        key = hashlib.sha256(f.read() + sys.version.encode()).hexdigest()[:16]
    return source, os.path.join(REPO, 'build', 'helpers-cache', key)


def _build_helpers(tree_path):
    """Compile the tree's helpers.cpp (once, cached) and return the extension's path."""
    source, cache = _helpers_cache_dir(tree_path)
    target = os.path.join(cache, 'helpers_cpp' + sysconfig.get_config_var('EXT_SUFFIX'))
    if os.path.exists(target):
        return target
    import pybind11

    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mktemp(dir=cache, suffix='.so')
    cmd = [
        os.environ.get('CXX', 'g++'),
        '-O2',
        '-shared',
        '-std=c++17',
        '-fPIC',
        '-I' + pybind11.get_include(),
        '-I' + sysconfig.get_paths()['include'],
        source,
        '-o',
        tmp,
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    os.replace(tmp, target)
    return target


def _register_helpers(path):
    name = 'megatron.core.datasets.helpers_cpp'
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


def _compile_helpers_shim(ctx):
    """Stand-in for megatron.core.datasets.utils.compile_helpers (no Makefile in the tree)."""

    def compile_helpers():
        _register_helpers(_build_helpers(ctx.tree_path))

    return compile_helpers


def _hexes(value):
    if isinstance(value, torch.Tensor):
        return [float(x).hex() for x in value.detach().float().reshape(-1).tolist()]
    if isinstance(value, (int, float)):
        return [float(value).hex()]
    return None if value is None else repr(value)


def _digest(model, optimizer):
    h = hashlib.sha256()
    for chunk in model:
        for name, p in chunk.named_parameters():
            t = p.detach().cpu().reshape(-1).contiguous()
            h.update(name.encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    model_digest = h.hexdigest()[:16]
    h = hashlib.sha256()
    for opt in getattr(optimizer, 'chained_optimizers', None) or [optimizer]:
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group['params']:
                t = p.detach().cpu().reshape(-1).contiguous()
                h.update(t.view(torch.uint8).numpy().tobytes())
                for key, value in sorted(inner.state.get(p, {}).items()):
                    h.update(key.encode())
                    if isinstance(value, torch.Tensor):
                        h.update(
                            value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                        )
                    else:
                        h.update(repr(value).encode())
    return model_digest, h.hexdigest()[:16]


def _log_recorder(out, original_log):
    """training_log, recording each real iteration's losses, lr, loss scale and grad norm."""

    @functools.wraps(original_log)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *a, **kw):
        skipped_iter, grad_norm = a[1], a[2]
        out['iterations'].append(
            {
                'iteration': iteration,
                'losses': {k: _hexes(v) for k, v in sorted(loss_dict.items())},
                'lr': _hexes(learning_rate),
                'loss_scale': _hexes(loss_scale),
                'grad_norm': _hexes(grad_norm),
                'skipped': int(skipped_iter),
            }
        )
        return original_log(
            loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *a, **kw
        )

    return training_log


def _train_recorder(out, original_train):
    """train, marking the time inside it and digesting the model and optimizer it leaves."""

    @functools.wraps(original_train)
    def train(forward_step_func, model, optimizer, opt_param_scheduler, *a, **kw):
        out['inside_train'] = True
        try:
            result = original_train(
                forward_step_func, model, optimizer, opt_param_scheduler, *a, **kw
            )
        finally:
            out['inside_train'] = False
        out['final_model'], out['final_optimizer'] = _digest(model, optimizer)
        out['final_scheduler_steps'] = opt_param_scheduler.num_steps
        return result

    return train


def _eval_recorder(out, original_evaluate):
    """evaluate, recording per call and loss key the value it returns (the one
    evaluate_and_print_results prints)."""

    @functools.wraps(original_evaluate)
    def evaluate(*a, **kw):
        result = original_evaluate(*a, **kw)
        totals = result[0] or {}
        out['evaluations'].append({key: _hexes(value) for key, value in sorted(totals.items())})
        return result

    return evaluate


def _warmup_recorders(out, training):
    """train_step counting the real steps and run_warmup recording each call: (both wrappers)."""
    original_run = training.run_warmup

    original_step = training.train_step
    real_steps = []

    @functools.wraps(original_step)
    def train_step(*a, **kw):
        if not out['warmup_calls'] or 'done' in out['warmup_calls'][-1]:
            real_steps.append(1)
        return original_step(*a, **kw)

    @functools.wraps(original_run)
    def run_warmup(*a, **kw):
        from megatron.training.global_vars import get_timers

        call = {
            'inside_train': out['inside_train'],
            'real_train_steps_before': len(real_steps),
            # train() creates its interval timer after the warmup hook.
            'interval_timer_before': 'interval-time' in get_timers().get_all_timers(),
        }
        out['warmup_calls'].append(call)
        try:
            report = original_run(*a, **kw)
            call['steps'] = len(report.losses)  # the steps that ran
            return report
        finally:
            call['done'] = True

    return train_step, run_warmup


@contextlib.contextmanager
def _recorders(out):
    """Wrap training_log / train (and run_warmup on the fork) to record what the run did."""
    from megatron.training import training

    original_log, original_train = training.training_log, training.train
    training_log = _log_recorder(out, original_log)
    train = _train_recorder(out, original_train)

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(training, 'training_log', training_log))
        stack.enter_context(patched(training, 'train', train))
        stack.enter_context(patched(training, 'evaluate', _eval_recorder(out, training.evaluate)))
        warmup = None
        with contextlib.suppress(ImportError):
            from megatron.training import warmup
        if warmup is not None:
            train_step, run_warmup = _warmup_recorders(out, training)
            stack.enter_context(patched(training, 'train_step', train_step))
            stack.enter_context(patched(training, 'run_warmup', run_warmup))
        yield


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


# ------------------------------------------------------------------------------------------------
# Scenario.


def _driver_script(ctx, driver, tag):
    """The driver's script, upstream's copied into a fresh work folder: (workdir, script)."""
    if driver == 'tiny_gpt':
        workdir, script = None, TINY_GPT
    elif driver == 'pretrain_gpt':
        from tests.harness import bases

        workdir = tempfile.mkdtemp(prefix=f'pretrain-gpt-r{ctx.rank}-')
        for name in UPSTREAM_FILES:
            with open(os.path.join(workdir, name), 'w') as f:
                f.write(read_upstream_file(name, tag or bases.upstream_ref()))
        script = os.path.join(workdir, 'pretrain_gpt.py')
    else:
        raise ValueError(f'unknown driver {driver!r}; known: {", ".join(DRIVERS)}')
    return workdir, script


def _prepare_world(ctx):
    """Empty the MTP loss tracker and give every rank the dataset helpers (rank 0 builds them)."""
    # A fresh pretrain_gpt.py process starts with empty loss trackers; an earlier scenario of the
    # same world may have left the class-level MTP tracker in another mode (dev asserts on that).
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker = {}
    if ctx.rank == 0:
        _build_helpers(ctx.tree_path)  # rank 0 compiles; the barrier below orders the others
    torch.distributed.barrier()
    # Every rank builds dataset indices (MockGPTDataset), so every rank needs the helper.
    _register_helpers(_build_helpers(ctx.tree_path))


@contextlib.contextmanager
def _expert_gemms_on_cpu():
    """On the fork, the warmup's routed-expert GEMM shapes run on CPU ranks too (they run only on
    cuBLAS's device otherwise), so that a CPU run goes through them as a GPU run does."""
    try:
        from megatron.training import warmup_expert_gemms
    except ImportError:  # pristine, or a fork without the change
        yield
        return
    with patched(warmup_expert_gemms, 'PREWARM_DEVICES', ('cuda', 'cpu')):
        yield


def _run_script(ctx, script, workdir, argv, out, on_cpu):
    """Run the script as __main__ with ``argv``, recording into ``out``; return (stdout, stderr)."""
    import_with_real_cuda('megatron.training.training')
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import initialize, training

    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script] + list(argv)
    sys.path.insert(0, workdir or os.path.dirname(script))
    try:
        with contextlib.ExitStack() as stack:
            if on_cpu:
                from tests.harness import cpu_redirect

                stack.enter_context(cpu_redirect.pretrain_mode())
                stack.enter_context(
                    patched(
                        training,
                        'initialize_megatron',
                        functools.partial(initialize.initialize_megatron, allow_no_cuda=True),
                    )
                )
                stack.enter_context(_expert_gemms_on_cpu())
            stack.enter_context(
                patched(dataset_utils, 'compile_helpers', _compile_helpers_shim(ctx))
            )
            stack.enter_context(_recorders(out))
            stack.enter_context(contextlib.redirect_stdout(_Tee(stdout, sys.stdout)))
            stack.enter_context(contextlib.redirect_stderr(_Tee(stderr, sys.stderr)))
            try:
                runpy.run_path(script, run_name='__main__')
            except SystemExit as exc:
                out['exit'] = exc.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name in ('model_provider', 'gpt_builders'):
            sys.modules.pop(name, None)
    return stdout, stderr


def _summarize(out, stdout, stderr):
    """Add the argparse error, the warmup log and the printed losses to ``out``."""
    errors = [line for line in stderr.getvalue().splitlines() if ': error: ' in line]
    out['argparse_error'] = errors[-1] if errors else None
    for call in out['warmup_calls']:
        call.pop('done', None)
    out['warmup_log'] = [
        line.strip() for line in stdout.getvalue().splitlines() if line.startswith('[warmup]')
    ]
    # What training_log printed (on the last rank): {iteration: lm loss as printed}.
    out['printed_loss'] = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r' iteration +(\d+)/ *\d+ \|.*? lm loss: (\S+) \|', stdout.getvalue())
    }


def scenario_pretrain_gpt(ctx, argv, driver='tiny_gpt', tag=None):
    """Run the ``driver``'s GPT script with ``argv`` through pretrain(); report what it did.

    Args:
        argv: command-line arguments after the script name.
        driver: 'tiny_gpt' (tests/driver/pretrain_tiny_gpt.py) or 'pretrain_gpt' (upstream's,
            from FORK_MEGATRON_LM at ``tag``).
        tag: Megatron-LM ref upstream's scripts are read from (default: the base's own).

    Returns:
        {'exit': SystemExit code or None, 'argparse_error': last 'error:' line on stderr,
        'iterations': [per real iteration: losses/lr/loss_scale/grad_norm as float hex],
        'final_model'/'final_optimizer': digests after train(), 'warmup_calls': [num_steps],
        'warmup_log': the '[warmup]' stdout lines, 'printed_loss': {iteration: lm loss},
        'evaluations': [per evaluate() call: {loss key: value as float hex}]}.
    """
    workdir, script = _driver_script(ctx, driver, tag)

    # What torchrun would export; pretrain_gpt.py reads RANK, the arguments the rest.
    os.environ.update(
        RANK=str(ctx.rank),
        LOCAL_RANK=str(ctx.rank if ctx.device.type == 'cuda' else 0),
        WORLD_SIZE=str(ctx.world_size),
    )
    out = {
        'inside_train': False,
        'exit': None,
        'argparse_error': None,
        'iterations': [],
        'warmup_calls': [],
        'warmup_log': [],
        'evaluations': [],
    }
    on_cpu = ctx.device.type == 'cpu'
    _prepare_world(ctx)
    stdout, stderr = _run_script(ctx, script, workdir, argv, out, on_cpu)
    _summarize(out, stdout, stderr)
    return out
