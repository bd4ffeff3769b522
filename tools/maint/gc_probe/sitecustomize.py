"""Garbage-collection probe for the issue 38 GPU runs (tools/maint/gpu_moe_speed.sh GC_PROBE=1).

Python imports ``sitecustomize`` at start-up from ``sys.path``; with this folder on PYTHONPATH
every collection of the process is timed (``gc.callbacks``). Each full (generation 2) collection
is written to stderr as it ends, ``[gc] gen2 <ms> ms collected <n>``, so that the log shows which
iterations it fell in, and at exit one line counts and times each generation:
``[gc] totals gen0: <n> in <ms> ms gen1: ... gen2: ...``. It changes nothing else.
"""

import atexit
import gc
import sys
import time

_started = []
_totals = [[0, 0.0] for _ in range(3)]


def _on_gc(phase, info):
    if phase == 'start':
        _started.append(time.perf_counter())
        return
    if not _started:
        return
    ms = (time.perf_counter() - _started.pop()) * 1e3
    generation = info['generation']
    _totals[generation][0] += 1
    _totals[generation][1] += ms
    if generation == 2:
        sys.stderr.write(f'[gc] gen2 {ms:.1f} ms collected {info["collected"]}\n')


@atexit.register
def _report():
    counts = ' '.join(f'gen{g}: {n} in {ms:.0f} ms' for g, (n, ms) in enumerate(_totals))
    sys.stderr.write(f'[gc] totals {counts}\n')


gc.callbacks.append(_on_gc)
