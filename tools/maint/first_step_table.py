#!/usr/bin/env python3
"""Table of first/second real iteration against steady state from gpu_first_step.sh logs.

    python3 tools/maint/first_step_table.py LOG_DIR [LOG_DIR ...]

Per log: iterations 1 and 2 and the median of iterations 5-30 ("elapsed time per iteration"),
their ratios, the peak allocated memory (the largest "max allocated" that report_memory prints;
it covers the warmup, which runs before the first iteration), and whether every iteration's lm
loss equals the "none" arm of the same model and repeat. "noise" is the share of iterations 3-30
of the same run that are themselves more than 5 % above that run's steady median: how often an
iteration with no one-time cost at all misses a 1.05 bound. "rank" is the share of the steady
iterations 5-30 that are faster than iteration 1 (and 2): an iteration at steady state ranks about
0.5 on average over many runs, one with a one-time cost near 1.0. A summary line per model and arm
gives the median, the smallest and the largest ratio over the repeats, and the mean rank. A
"control" line per model gives the same for iterations 3 and 4 of the "none" arm: its first
iterations after its own one-time costs, i.e. what a first iteration without any one-time cost
reads on the same machine. Several LOG_DIRs pool their runs into one table.
"""

import gzip
import pathlib
import re
import statistics
import sys

ITER = re.compile(
    r'iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+)'
    r'.*?lm loss: ([0-9.E+-]+)'
)
PEAK = re.compile(r'max allocated: ([0-9.]+)')


def parse(path: pathlib.Path) -> dict:
    """Iteration times and losses, and the peak allocated memory, of one log."""
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rt', errors='replace') as handle:
        text = handle.read()
    times, losses = {}, {}
    for it, ms, loss in ITER.findall(text):
        times[int(it)], losses[int(it)] = float(ms), loss
    peaks = [float(value) for value in PEAK.findall(text)]
    return {'times': times, 'losses': losses, 'peak': max(peaks) if peaks else None}


def rank(times: dict, n: int) -> float:
    """Share of the steady iterations 5-30 that are faster than iteration ``n``."""
    return sum(times[i] < times[n] for i in range(5, 31)) / 26


def main(*log_dirs: str) -> int:
    """Print the markdown table; exit 1 when a log has no iterations. With several directories
    the repeats are pooled, each named after its directory (run5/small-none-a1 -> run5a1)."""
    logs = {}
    for log_dir in log_dirs:
        prefix = pathlib.Path(log_dir).name.replace('-', '') if len(log_dirs) > 1 else ''
        paths = sorted(pathlib.Path(log_dir).glob('*.log*'))
        if not paths:
            sys.exit(f'first_step_table.py: no *.log or *.log.gz files in {log_dir}')
        for path in paths:
            model, arm, rep = path.name.split('.')[0].split('-')
            logs[f'{model}-{arm}-{prefix}{rep}'] = parse(path)
    print(
        '| model | arm | repeat | 1st ms | 2nd ms | steady ms (median 5-30) | 1st / steady '
        '| 2nd / steady | noise | rank 1st, 2nd | peak alloc MB | losses = none |'
    )
    print('|---|---|---|---|---|---|---|---|---|---|---|---|')
    status, ratios = 0, {}
    for name, run in logs.items():
        model, arm, rep = name.split('-')
        times = run['times']
        if len(times) < 30:
            print(f'| {model} | {arm} | {rep} | (incomplete: {len(times)} iterations) |')
            status = 1
            continue
        steady = statistics.median(times[i] for i in range(5, 31))
        noise = sum(times[i] > 1.05 * steady for i in range(3, 31)) / 28
        # The same repeat's "none" run, else any "none" run of the model (losses are seeded).
        nones = [v for k, v in logs.items() if k.startswith(f'{model}-none-')]
        none = logs.get(f'{model}-none-{rep}', nones[0] if nones else {}).get('losses')
        same = 'yes' if run['losses'] == none else 'NO'
        first, second = times[1] / steady, times[2] / steady
        ranks = [rank(times, 1), rank(times, 2)]
        ratios.setdefault((model, arm), []).append((first, second, *ranks))
        if arm == 'none':
            control = (times[3] / steady, times[4] / steady, rank(times, 3), rank(times, 4))
            ratios.setdefault((model, 'control'), []).append(control)
        print(
            f'| {model} | {arm} | {rep} | {times[1]:.1f} | {times[2]:.1f} | {steady:.1f} '
            f'| {first:.2f} | {second:.2f} | {noise:.0%} | {ranks[0]:.2f}, {ranks[1]:.2f} '
            f'| {run["peak"]} | {same} |'
        )
    print()
    for (model, arm), pairs in ratios.items():
        summary = []
        columns = list(zip(*pairs))
        labels = ('3rd', '4th') if arm == 'control' else ('1st', '2nd')
        for label, values, ranks in zip(labels, columns[:2], columns[2:]):
            within = sum(v <= 1.05 for v in values)
            summary.append(
                f'{label}/steady median {statistics.median(values):.2f}, '
                f'range {min(values):.2f}-{max(values):.2f}, <= 1.05 in {within} of {len(values)}, '
                f'mean rank {statistics.mean(ranks):.2f}'
            )
        name = f'{model} control (none arm)' if arm == 'control' else f'{model} {arm}'
        print(f'- {name}: ' + '; '.join(summary))
    return status


if __name__ == '__main__':
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
