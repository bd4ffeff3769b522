"""Step probe for the issue 38 GPU runs (tools/maint/gpu_moe_speed.sh PROBE=tools/maint/step_probe):
where a run's train steps, the warmup's and the real ones, spend their time.

Python imports ``sitecustomize`` at start-up from ``sys.path``. With this folder on PYTHONPATH,
``megatron.training.training.train_step`` is wrapped as that module is imported (train() and the
warmup look it up there), and each call is logged on stderr as it ends:

  [probe] call N step_ms S gap_ms G data_ms D gc_ms C gc2 K mallocs M frees F retries R
          gap_mallocs GM reserved_gb X t T

- step_ms: the call, with ``torch.cuda.synchronize()`` at both ends;
- gap_ms: from the end of the previous call to the start of this one (training_log and the
  loop around the step; ``nan`` for the first call);
- data_ms: time inside ``RerunDataIterator.__next__`` during the call (the batches);
- gc_ms, gc2: time in garbage collection during the call, and how many collections were full;
- mallocs, frees, retries: segments the caching allocator took from and gave back to the driver
  (``cudaMalloc``/``cudaFree``) and its allocation retries during the call; gap_mallocs: segments
  taken during the gap; reserved_gb: reserved memory after the call;
- t: the wall clock at the end (to line up with ``nvidia-smi`` samples).

``PROBE_FREEZE_AT=N`` calls ``gc.freeze()`` right before call N (with 5 warmup steps, N = 6 is the
first real one): a candidate, everything alive then counted as long-lived.
``PROBE_PAUSE=N:MS`` sleeps MS milliseconds before call N, inside its gap: a steady step after an
idle pause as long as the warmup's restore, to compare with the first real one.
``PROBE_PROFILE=N,M,...`` runs those calls under cProfile and writes the 25 functions with the
most own time after each call's line (``[probe-prof N] ncalls tottime_ms cumtime_ms function``):
the host's time in the first real step against a steady one. Without CUDA the
synchronizations and allocator counts are left out (0). A measurement only: the synchronizations
take away the overlap of one step with the next.
"""

import cProfile
import gc
import importlib.abc
import importlib.util
import os
import pstats
import sys
import time

_gc = {'start': None, 'ms': 0.0, 'gen2': 0}
_data = {'ms': 0.0}


def _on_gc(phase, info):
    if phase == 'start':
        _gc['start'] = time.perf_counter()
    elif _gc['start'] is not None:
        _gc['ms'] += (time.perf_counter() - _gc['start']) * 1e3
        _gc['gen2'] += info['generation'] == 2
        _gc['start'] = None


gc.callbacks.append(_on_gc)


def _cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def _stats(cuda):
    """(segments allocated, segments freed, allocation retries, reserved bytes) so far."""
    if cuda is None:
        return (0, 0, 0, 0)
    s = cuda.memory_stats()
    keys = ('segment.all.allocated', 'segment.all.freed', 'num_alloc_retries')
    return tuple(s.get(k, 0) for k in keys) + (s.get('reserved_bytes.all.current', 0),)


def _profile_lines(profile, call, top=25):
    """The ``top`` functions of ``profile`` by own time, one ``[probe-prof N]`` line each."""
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        f"[probe-prof {call}] {nc} {tt * 1e3:.2f} {ct * 1e3:.2f} "
        f"{os.path.basename(f)}:{line}:{name}\n"
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]


def wrap_train_step(
    original, freeze_at=0, write=sys.stderr.write, pause=(0, 0.0), profile_calls=()
):
    """``original`` (train_step's signature) with each call timed and logged as above."""
    state = {'n': 0, 'end': None, 'end_stats': None}

    def train_step(*args, **kwargs):
        cuda = _cuda()
        call = state['n'] + 1
        if call == freeze_at:
            gc.freeze()
            write(f"[probe] gc.freeze() before call {freeze_at}: {gc.get_freeze_count()}\n")
        if call == pause[0]:
            time.sleep(pause[1] / 1e3)
        profile = cProfile.Profile() if call in profile_calls else None
        if cuda is not None:
            cuda.synchronize()
        t0, s0 = time.perf_counter(), _stats(cuda)
        gap = (t0 - state['end']) * 1e3 if state['end'] is not None else float('nan')
        gap_mallocs = s0[0] - state['end_stats'][0] if state['end_stats'] else 0
        gc0, gen2_0, data0 = _gc['ms'], _gc['gen2'], _data['ms']
        if profile is not None:
            profile.enable()
        try:
            result = original(*args, **kwargs)
            if cuda is not None:
                cuda.synchronize()
        finally:
            if profile is not None:
                profile.disable()
        t1, s1 = time.perf_counter(), _stats(cuda)
        state['n'] += 1
        write(
            f"[probe] call {state['n']} step_ms {(t1 - t0) * 1e3:.1f} gap_ms {gap:.1f} "
            f"data_ms {_data['ms'] - data0:.1f} gc_ms {_gc['ms'] - gc0:.1f} "
            f"gc2 {_gc['gen2'] - gen2_0} mallocs {s1[0] - s0[0]} frees {s1[1] - s0[1]} "
            f"retries {s1[2] - s0[2]} gap_mallocs {gap_mallocs} "
            f"reserved_gb {s1[3] / 2**30:.2f} t {time.time():.3f}\n"
        )
        if profile is not None:
            write(''.join(_profile_lines(profile, state['n'])))
        state['end'], state['end_stats'] = time.perf_counter(), s1
        return result

    train_step.step_probe = True
    return train_step


def _patch_training(module):
    freeze_at = int(os.environ.get('PROBE_FREEZE_AT', '0'))
    pause = os.environ.get('PROBE_PAUSE', '0:0').split(':')
    profile_calls = {int(n) for n in os.environ.get('PROBE_PROFILE', '').split(',') if n}
    module.train_step = wrap_train_step(
        module.train_step,
        freeze_at,
        pause=(int(pause[0]), float(pause[1])),
        profile_calls=profile_calls,
    )


def _patch_rerun(module):
    original = module.RerunDataIterator.__next__

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            _data['ms'] += (time.perf_counter() - t0) * 1e3

    __next__.step_probe = True
    module.RerunDataIterator.__next__ = __next__


_HOOKS = {
    'megatron.training.training': _patch_training,
    'megatron.core.rerun_state_machine': _patch_rerun,
}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the hooked modules as the other finders do, and patches each once it has run."""

    def find_spec(self, fullname, path, target=None):
        """The spec the other finders give a hooked module, its loader patching after exec."""
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
