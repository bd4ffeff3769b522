#!/usr/bin/env python3
"""The first five real iterations against steady state, per model and arm (issue 25's table).

    python3 tools/maint/first_five_table.py LOG_DIR [LOG_DIR ...]

Reads the ``<model>-<arm>-<repeat>.log[.gz]`` files that tools/maint/gpu_first_five.sh writes
(upstream's pretrain_gpt.py with --log-interval 1). Per log: the first five iterations that ran
an optimizer step (fp16's loss scaler skips iterations without one: they print no grad norm and
are left out, as is every iteration after them that the scaler skipped), each divided by the
median of iterations 10-30 of the same run. Per model and arm the ratios are pooled over the
repeats and over the directories: the median and the largest ratio of each of the five positions,
and how many of them are within 1.05. The "none" arm's iterations 6-10 (its first after its own
one-time costs) are the noise control: what a step without any one-time cost reads there.
"losses = none": every iteration's lm loss equals that of the same model's "none" run of the same
repeat (a warmup must not change the run).
"""

import gzip
import pathlib
import re
import statistics
import sys

ITER = re.compile(
    r'iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+)'
    r'.*?lm loss: ([0-9.E+-]+)(?P<rest>.*)'
)
BOUND = 1.05
STEADY = range(10, 31)
FIRST = 5


def parse(path: pathlib.Path) -> dict:
    """{iteration: (ms, lm loss, stepped)} of one log; stepped: the line has a grad norm."""
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rt', errors='replace') as handle:
        lines = handle.read().splitlines()
    out = {}
    for line in lines:
        m = ITER.search(line)
        if m:
            out[int(m.group(1))] = (float(m.group(2)), m.group(3), 'grad norm' in m.group('rest'))
    return out


def ratios(run: dict, positions) -> list:
    """Time / steady median of the iterations at ``positions`` among those that stepped."""
    steady = statistics.median(run[i][0] for i in STEADY if i in run)
    stepped = [i for i in sorted(run) if run[i][2]]
    return [run[stepped[p]][0] / steady for p in positions if p < len(stepped)]


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
    for (model, arm, rep), run in runs.items():
        if any(i not in run for i in STEADY):
            print(f'{model}-{arm}-{rep}: incomplete ({len(run)} iterations)', file=sys.stderr)
            status = 1
            continue
        none = runs.get((model, 'none', rep))
        same = none is not None and [v[1] for v in run.values()] == [v[1] for v in none.values()]
        entry = pooled.setdefault((model, arm), {'ratios': [], 'same': True, 'n': 0})
        entry['ratios'].append(ratios(run, range(FIRST)))
        entry['same'] &= same
        entry['n'] += 1
        if arm == 'none':
            control = pooled.setdefault((model, 'control'), {'ratios': [], 'same': True, 'n': 0})
            control['ratios'].append(ratios(run, range(FIRST, 2 * FIRST)))
            control['n'] += 1
    head = ' | '.join(f'it {p + 1} median (max)' for p in range(FIRST))
    print(f'| model | arm | runs | {head} | within {BOUND} | losses = none |')
    print('|---|---|---|' + '---|' * FIRST + '---|---|')
    for (model, arm), entry in sorted(pooled.items()):
        columns = list(zip(*entry['ratios']))
        cells = [f'{statistics.median(c):.2f} ({max(c):.2f})' for c in columns]
        within = sum(v <= BOUND for c in columns for v in c)
        total = sum(len(c) for c in columns)
        same = '-' if arm in ('none', 'control') else ('yes' if entry['same'] else 'NO')
        name = 'control (none, it 6-10)' if arm == 'control' else arm
        print(
            f'| {model} | {name} | {entry["n"]} | '
            + ' | '.join(cells)
            + f' | {within}/{total} | {same} |'
        )
    return status


if __name__ == '__main__':
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
