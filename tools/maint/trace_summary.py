#!/usr/bin/env python3
"""Summarise a torch.profiler chrome trace (the ``rank-N.json.gz`` that upstream's
``--profile --use-pytorch-profiler`` writes): where the time of each profiled step goes.

    tools/maint/trace_summary.py TRACE [TRACE ...] [--top N]

Per trace: per profiled step (``ProfilerStep#N``) its wall time, the GPU busy time (the union
of the kernel and memcpy/memset intervals in that step) and the launches; then, over all steps,
the kernels by total GPU time, the host-side CUDA calls (launches, synchronisations, copies,
allocations) and the CPU events by inclusive time (compiled regions, autograd functions, aten
ops). GPU busy well below the wall time means the step waits on the host (launch-bound).
Exit codes: 0 summary printed, 2 a trace could not be read or has no profiled step.
"""

import argparse
import collections
import gzip
import json
import sys

GPU_CATS = {'kernel', 'gpu_memcpy', 'gpu_memset'}
HOST_CUDA_CATS = {'cuda_runtime', 'cuda_driver'}


def load(path):
    """The trace's complete ('X') events."""
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rt') as f:
        trace = json.load(f)
    events = trace['traceEvents'] if isinstance(trace, dict) else trace
    return [e for e in events if e.get('ph') == 'X' and 'dur' in e]


def union_length(intervals):
    """Total length covered by (start, end) intervals."""
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarise(events, top):
    """Lines of text for one trace."""
    steps = sorted(
        (
            e
            for e in events
            if str(e.get('name', '')).startswith('ProfilerStep#')
            and not str(e.get('cat', '')).startswith('gpu')
        ),
        key=lambda e: e['ts'],
    )
    if not steps:
        return None
    lines = ['step | wall ms | GPU busy ms | busy/wall | kernel launches']
    gpu = [e for e in events if e.get('cat') in GPU_CATS]
    host = [e for e in events if e.get('cat') in HOST_CUDA_CATS]
    first, last = steps[0]['ts'], steps[-1]['ts'] + steps[-1]['dur']
    for step in steps:
        lo, hi = step['ts'], step['ts'] + step['dur']
        # a kernel belongs to the step whose host interval launched it; GPU work runs later,
        # so clip the kernels that start inside the step's wall interval
        busy = union_length(
            (max(e['ts'], lo), min(e['ts'] + e['dur'], hi))
            for e in gpu
            if e['ts'] < hi and e['ts'] + e['dur'] > lo
        )
        launches = sum(1 for e in host if 'Launch' in e['name'] and lo <= e['ts'] < hi)
        lines.append(
            f"{step['name']} | {step['dur'] / 1e3:.2f} | {busy / 1e3:.2f} | "
            f"{busy / step['dur']:.2f} | {launches}"
        )
    n = len(steps)

    def table(title, rows):
        lines.append('')
        lines.append(f'{title} (per step: ms, calls)')
        for name, (dur, count) in rows[:top]:
            lines.append(f'  {dur / n / 1e3:9.3f} {count / n:8.1f}  {name[:110]}')

    def by_name(selected):
        acc = collections.defaultdict(lambda: [0.0, 0])
        for e in selected:
            acc[e['name']][0] += e['dur']
            acc[e['name']][1] += 1
        return sorted(acc.items(), key=lambda kv: -kv[1][0])

    in_window = [e for e in events if first <= e['ts'] < last]
    table(
        'GPU: kernels and copies by time', by_name(e for e in in_window if e.get('cat') in GPU_CATS)
    )
    table(
        'host: CUDA runtime and driver calls',
        by_name(e for e in in_window if e.get('cat') in HOST_CUDA_CATS),
    )
    cpu = [
        e
        for e in in_window
        if e.get('cat') in ('cpu_op', 'user_annotation', 'python_function')
        and not str(e.get('name', '')).startswith('ProfilerStep#')
    ]
    table('CPU: events by inclusive time', by_name(cpu))
    compiled = [e for e in cpu if 'Compiled' in e['name'] or 'Torch-Compiled' in e['name']]
    table('CPU: compiled regions and their autograd functions', by_name(compiled))
    return lines


def main(argv=None):
    """Parse the arguments, print each trace's summary; the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('traces', nargs='+')
    parser.add_argument('--top', type=int, default=25)
    args = parser.parse_args(argv)
    for path in args.traces:
        try:
            events = load(path)
        except (OSError, ValueError, KeyError) as exc:
            print(
                f'{path}: cannot read the trace ({exc}); pass the rank-N.json.gz that '
                '--use-pytorch-profiler wrote',
                file=sys.stderr,
            )
            return 2
        lines = summarise(events, args.top)
        if lines is None:
            print(
                f'{path}: no ProfilerStep# event; profile at least one step '
                '(--profile-step-start < --profile-step-end)',
                file=sys.stderr,
            )
            return 2
        print(f'== {path}')
        print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main())
