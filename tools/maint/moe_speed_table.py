"""The MoE speed table (issue 38) from the logs of tools/maint/gpu_moe_speed.sh.

    python3 tools/maint/moe_speed_table.py LOG_DIR [--markdown]

Per run (``<model>-<arm>-<tag><rep>.log``): the steady step (median of real iterations 11 to the
last), the first five real iterations over it, the recompiles that dynamo logged in each real
iteration (``TORCH_LOGS=recompiles``: a ``Recompiling function`` line belongs to the iteration
whose line follows it; lines before a ``[warmup] Ran`` line belong to the warmup), the lm
loss of every iteration, and the run's own spread: how many steady iterations take more than 1.10
of the steady median (a host-bound step varies from one iteration to the next, so a single early
iteration over 1.10 means little where steady ones are too). Per model, for each repeat: steady
fork / pristine and fork / eager of the runs of that repeat (one device call, back to back), and
the largest relative loss distance of each arm from pristine against that of eager from pristine.
"""

import argparse
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r'^(?P<model>[a-z0-9]+)-(?P<arm>[a-z0-9-]+)-(?P<tag>[a-z]+)(?P<rep>\d+)\.log$')
ITERATION = re.compile(
    r'iteration\s+(?P<it>\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): (?P<ms>[\d.]+)'
)
LOSS = re.compile(r'lm loss: (?P<loss>[\d.E+-]+)')
RECOMPILE = re.compile(r'Recompiling function (?P<fn>\w+)')
WARMUP = re.compile(r'\[warmup\] Ran (?P<steps>\d+) warmup train steps')
SPREAD = 1.10  # the bound on the first five, applied to the steady iterations
GRAPHS = re.compile(r'(?P<graphs>\d+) torch\.compile (graphs compiled|compilations)')


def parse_log(text):
    """{'ms': {it: ms}, 'loss': {it: loss}, 'recompiles': {it: [fn, ...]}, 'warmup_recompiles':
    [fn, ...] or None without a warmup, 'warmup_graphs': int or None}."""
    run = {'ms': {}, 'loss': {}, 'recompiles': {}, 'warmup_recompiles': None, 'warmup_graphs': None}
    pending = []
    for line in text.splitlines():
        m = RECOMPILE.search(line)
        if m:
            pending.append(m['fn'])
            continue
        m = WARMUP.search(line)
        if m:
            run['warmup_recompiles'], pending = pending, []
            g = GRAPHS.search(line)
            run['warmup_graphs'] = int(g['graphs']) if g else None
            continue
        m = ITERATION.search(line)
        if m:
            it = int(m['it'])
            run['ms'][it] = float(m['ms'])
            loss = LOSS.search(line)
            if loss:
                run['loss'][it] = float(loss['loss'])
            run['recompiles'][it], pending = pending, []
    return run


def summarize(run, steady_from=11):
    """Steady median (iterations >= steady_from), first five over steady, recompiles per
    iteration (only iterations that had some)."""
    later = [ms for it, ms in run['ms'].items() if it >= steady_from]
    if not later:
        return None
    steady = statistics.median(later)
    return {
        'above': (sum(ms > SPREAD * steady for ms in later), len(later)),
        'steady': steady,
        'first5': [run['ms'][it] / steady for it in range(1, 6) if it in run['ms']],
        'recompiles': {it: len(fns) for it, fns in run['recompiles'].items() if fns},
        'warmup': None if run['warmup_recompiles'] is None else len(run['warmup_recompiles']),
        'warmup_graphs': run['warmup_graphs'],
    }


def load(log_dir):
    """{(model, arm, tag+rep): parsed run} for every log in ``log_dir``."""
    runs = {}
    for path in sorted(Path(log_dir).glob('*.log')):
        m = NAME.match(path.name)
        if m:
            runs[(m['model'], m['arm'], m['tag'] + m['rep'])] = parse_log(path.read_text())
    return runs


def _loss_distance(run, ref):
    common = sorted(set(run['loss']) & set(ref['loss']))
    if not common:
        return None
    return max(abs(run['loss'][i] - ref['loss'][i]) / abs(ref['loss'][i]) for i in common)


def table(runs):
    """Markdown lines: one row per run, then the per-repeat ratios of each model."""
    out = [
        '| model | arm | run | steady ms | first five / steady | recompiles (iteration: count) '
        f'| in warmup (logged / graphs) | steady over {SPREAD:.2f} of steady |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for (model, arm, rep), run in sorted(runs.items()):
        s = summarize(run)
        if s is None:
            out.append(f'| {model} | {arm} | {rep} | no steady iterations | | | | |')
            continue
        first5 = ' '.join(f'{r:.2f}' for r in s['first5'])
        rec = ', '.join(f'{it}: {n}' for it, n in sorted(s['recompiles'].items())) or 'none'
        warm = '' if s['warmup'] is None else f"{s['warmup']} / {s['warmup_graphs']}"
        above = '{} of {}'.format(*s['above'])
        out.append(
            f"| {model} | {arm} | {rep} | {s['steady']:.1f} | {first5} | {rec} | {warm} | {above} |"
        )
    out += [
        '',
        '| model | run | fork / pristine | fork / eager | loss distance from pristine '
        '(fork; eager) |',
        '|---|---|---|---|---|',
    ]
    for model, rep in sorted({(m, r) for m, _, r in runs}):
        arms = {a: runs[(m, a, r)] for m, a, r in runs if (m, r) == (model, rep)}
        steady = {a: (summarize(run) or {}).get('steady') for a, run in arms.items()}

        def ratio(a, b):
            return f'{steady[a] / steady[b]:.3f}' if steady.get(a) and steady.get(b) else ''

        dist = []
        for a in ('fork', 'eager'):
            d = (
                _loss_distance(arms[a], arms['pristine'])
                if a in arms and 'pristine' in arms
                else None
            )
            dist.append('' if d is None else f'{d:.1e}')
        out.append(
            f"| {model} | {rep} | {ratio('fork', 'pristine')} | {ratio('fork', 'eager')} "
            f"| {'; '.join(dist)} |"
        )
    return out


def main(argv=None):
    """Print the table of the logs in the folder given; exit 2 when it holds none."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
    parser.add_argument('log_dir')
    args = parser.parse_args(argv)
    runs = load(args.log_dir)
    if not runs:
        print(
            f'moe_speed_table.py: no <model>-<arm>-<tag><rep>.log in {args.log_dir}',
            file=sys.stderr,
        )
        return 2
    print('\n'.join(table(runs)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
