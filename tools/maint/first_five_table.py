#!/usr/bin/env python3
"""The first five real iterations against steady state, per model and arm (issue 25's table).

    python3 tools/maint/first_five_table.py LOG_DIR [LOG_DIR ...]

Reads the ``<model>-<arm>-<repeat>.log[.gz]`` files that tools/maint/gpu_first_five.sh writes
(upstream's pretrain_gpt.py with --log-interval 1). Only iterations that ran an optimizer step
count: fp16's loss scaler skips iterations (their line has neither lm loss nor grad norm), and
they are left out. Per log: the first five stepped iterations, each divided by the median of the
10th-30th stepped ones (iterations 10-30 of a bf16 run; at least 8 of them, so a 30-iteration
fp16 run whose scaler skipped 13 reads its last 8). Per model and arm the ratios are pooled over
the repeats and over the directories: the median and the largest ratio of each of the five
positions, and how many of them are within 1.05. The "none" arm's 6th-10th stepped iterations
(its first after its own one-time costs) are the noise control: what a step without any one-time
cost reads there.
"losses = none": every lm loss and grad norm (iteration by iteration, as printed) equals that of
every "none" run of the same model (a warmup must not change the run; the runs are
deterministic, so all none runs agree).
"""

import gzip
import pathlib
import re
import statistics
import sys

ITER = re.compile(
    r'iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+)(?P<rest>.*)'
)
LOSS = re.compile(r'lm loss: ([0-9.E+-]+)')
NORM = re.compile(r'grad norm: ([0-9.E+-]+)')
BOUND = 1.05
STEADY = range(9, 30)  # the 10th-30th stepped iterations (0-based positions)
MIN_STEADY = 8
FIRST = 5


def parse(path: pathlib.Path) -> dict:
    """{iteration: (ms, lm loss or None, grad norm or None)} of one log; an iteration stepped
    when its line has a grad norm."""
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rt', errors='replace') as handle:
        lines = handle.read().splitlines()
    out = {}
    for line in lines:
        m = ITER.search(line)
        if m:
            loss = LOSS.search(m.group('rest'))
            norm = NORM.search(m.group('rest'))
            out[int(m.group(1))] = (
                float(m.group(2)),
                loss.group(1) if loss else None,
                norm.group(1) if norm else None,
            )
    return out


def stepped(run: dict) -> list:
    """The times of the iterations that stepped, in order."""
    return [run[i][0] for i in sorted(run) if run[i][2] is not None]


def steady_positions(run: dict) -> list:
    """The 10th-30th stepped iterations; a run with fewer than MIN_STEADY of them (fp16 whose
    scaler skipped most of a short run) falls back on every stepped one after the first five."""
    count = len(stepped(run))
    positions = [p for p in STEADY if p < count]
    return positions if len(positions) >= MIN_STEADY else list(range(FIRST, count))


def ratios(run: dict, positions) -> list:
    """Time / steady median of the stepped iterations at ``positions``."""
    times = stepped(run)
    steady = statistics.median(times[p] for p in steady_positions(run))
    return [times[p] / steady for p in positions if p < len(times)]


def losses(run: dict) -> list:
    """(iteration, lm loss, grad norm) of every iteration that printed a loss, as printed."""
    return [(i, run[i][1], run[i][2]) for i in sorted(run) if run[i][1] is not None]


def main(*log_dirs: str) -> int:
    """Print the table; exit 1 when a log lacks the steady iterations."""
    runs = {}
    for log_dir in log_dirs:
        paths = sorted(pathlib.Path(log_dir).glob('*.log*'))
        if not paths:
            sys.exit(f'first_five_table.py: no *.log or *.log.gz files in {log_dir}')
        for path in paths:
            model, arm, rep = path.name.split('.')[0].split('-')
            runs[(model, arm, f'{pathlib.Path(log_dir).name}/{rep}')] = parse(path)
    status, pooled = 0, {}
    nones = {}
    for (model, arm, _), run in runs.items():
        if arm == 'none':
            nones.setdefault(model, []).append(losses(run))
    for (model, arm, rep), run in runs.items():
        positions = steady_positions(run)
        if len(positions) < MIN_STEADY:
            print(
                f'{model}-{arm}-{rep}: incomplete ({len(stepped(run))} stepped iterations)',
                file=sys.stderr,
            )
            status = 1
            continue
        short = positions[0] != STEADY[0]
        same = bool(nones.get(model)) and all(losses(run) == other for other in nones[model])
        entry = pooled.setdefault((model, arm), {'ratios': [], 'same': True, 'n': 0, 'short': 0})
        entry['ratios'].append(ratios(run, range(FIRST)))
        entry['same'] &= same
        entry['n'] += 1
        entry['short'] += short
        if arm == 'none':
            control = pooled.setdefault(
                (model, 'control'), {'ratios': [], 'same': True, 'n': 0, 'short': 0}
            )
            control['ratios'].append(ratios(run, range(FIRST, 2 * FIRST)))
            control['n'] += 1
            control['short'] += short
    head = ' | '.join(f'it {p + 1} median (max)' for p in range(FIRST))
    print(f'| model | arm | runs | {head} | within {BOUND} | losses = none |')
    print('|---|---|---|' + '---|' * FIRST + '---|---|')
    for (model, arm), entry in sorted(pooled.items()):
        columns = list(zip(*entry['ratios']))
        cells = [f'{statistics.median(c):.2f} ({max(c):.2f})' for c in columns]
        within = sum(v <= BOUND for c in columns for v in c)
        total = sum(len(c) for c in columns)
        # for the none arm: whether its runs agree among themselves
        same = '-' if arm == 'control' else ('yes' if entry['same'] else 'NO')
        name = 'control (none, it 6-10)' if arm == 'control' else arm
        print(
            f'| {model} | {name} | {entry["n"]}{"*" if entry["short"] else ""} | '
            + ' | '.join(cells)
            + f' | {within}/{total} | {same} |'
        )
    if any(entry['short'] for entry in pooled.values()):
        print(
            '\n* fewer than 8 of the 10th-30th iterations stepped (fp16): steady is the median of '
            'the stepped iterations after the first five, which the control overlaps'
        )
    return status


if __name__ == '__main__':
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
