#!/usr/bin/env python3
"""Per-stage cost of the pipeline warmup (``--warmup-train-steps``), on CPU ranks.

Runs upstream's own ``pretrain_gpt.py`` (read from the Megatron-LM mirror at the selected base's
ref, as tests/test_pretrain.py does) through the real ``pretrain()`` in a harness world (gloo, the
harness's CUDA redirect), with pipeline parallelism and ``--warmup-train-steps N``, and times on
every rank, for each warmup step and the first real steps after it:

- ``wall``: the whole ``train_step`` call;
- ``fwd`` / ``bwd``: time inside the schedule's ``forward_step`` / ``backward_step`` (compute,
  loss included on the last stage);
- ``p2p``: time inside ``P2PCommunicator._communicate`` (sends and receives; with tiny tensors on
  one host this is almost all waiting for the peer stage), and ``recv1``: the first call of the
  step that receives an activation, i.e. how long the stage waited for the stages before it;
- ``fin`` / ``opt``: ``finalize_model_grads`` and ``optimizer.step``;
- ``other``: the rest of the step (zeroing grads, schedule bookkeeping, loss averaging).
- ``fwd1@``: when the stage's first forward started, from the start of its step.

and, per rank, what ``run_warmup()`` spends outside its steps: ``stage`` (building the
``TrainingStateSnapshot``: host staging), ``sync`` (the all-reduce after each step that tells every
rank whether a step failed anywhere; it waits for the slowest stage), ``restore`` and ``gc`` (the
final ``gc.collect()``).

Nothing is changed in what runs: the timers wrap upstream functions by module attribute (the
originals run) and add no barrier or synchronization. The model is a small local-spec GPT (mock
data, bf16, DDP with overlap_grad_reduce and the distributed optimizer), seeds fixed (``--seed``
and the harness's ``torch.manual_seed(1234)``). Timings are wall clock on a shared machine: read
them for their shape (which stage waits, first step against the later ones), not to the
millisecond.

Usage (from the repository root, after ``tools/install.sh --test-deps``; the base is
``FORK_TEST_BASE``, default 0.19.2):

    nice -n 10 .venv/bin/python tools/maint/warmup_pp_timing.py --layout 2:2 --layout 4:4 \
        --warmup-steps 3 --real-steps 3 --repeats 3 --no-warmup-arm --out /tmp/warmup-pp.json

``--layout WORLD:PP`` (data parallel = WORLD / PP). ``--no-warmup-arm`` also runs every layout
without the warmup, so its first real steps are the cold ones; the arms alternate within each
repeat. The table (the median of the repeats per cell) goes to stdout as markdown.
"""

import argparse
import contextlib
import functools
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = 'tools.maint.warmup_pp_timing:scenario_timing'
PHASES = ('fwd', 'bwd', 'p2p', 'fin', 'opt')


def gpt_argv(pp, dp, layers, hidden, seq, micro_batch, microbatches, iters, warmup_steps):
    """pretrain_gpt.py arguments: tests/scenarios/pretrain.py's tiny GPT, resized, with PP."""
    from tests.scenarios.pretrain import tiny_gpt_args

    argv = tiny_gpt_args(dp, train_iters=iters)
    sizes = {
        '--num-layers': layers,
        '--hidden-size': hidden,
        '--ffn-hidden-size': 4 * hidden,
        '--seq-length': seq,
        '--max-position-embeddings': seq,
        '--micro-batch-size': micro_batch,
        '--global-batch-size': micro_batch * microbatches * dp,
    }
    for flag, value in sizes.items():
        argv[argv.index(flag) + 1] = str(value)
    argv += ['--pipeline-model-parallel-size', str(pp)]
    argv += ['--warmup-train-steps', str(warmup_steps)]
    return argv


class _Recorder:
    """Per-step accumulators, filled by the wrappers below."""

    def __init__(self):
        self.phase = 'real'
        self.step = None
        self.steps = []
        self.warmup_seconds = None
        self.outside = {}  # run_warmup()'s own work outside the steps: stage, sync, restore, gc

    def add(self, key, seconds):
        """Add ``seconds`` to ``key`` of the step that is running (none: ignored)."""
        if self.step is not None:
            self.step[key] = self.step.get(key, 0.0) + seconds

    def add_outside(self, key, seconds):
        """Add ``seconds`` to ``key`` of run_warmup()'s own work outside the steps."""
        self.outside[key] = self.outside.get(key, 0.0) + seconds


def _timed(rec, key, fn, on_start=None, outside=False):
    add = rec.add_outside if outside else rec.add

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        start = time.perf_counter()
        if on_start is not None:
            on_start(start, a, kw)
        try:
            return fn(*a, **kw)
        finally:
            add(key, time.perf_counter() - start)

    return wrapper


@contextlib.contextmanager
def _instrument(rec):
    import gc

    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.training import state_snapshot, training, warmup
    from tests.scenarios.common import patched

    def first_forward(start, a, kw):
        if rec.step is not None and 'fwd1_at' not in rec.step:
            rec.step['fwd1_at'] = start - rec.step['t0']

    original_comm = p2p_communication.P2PCommunicator._communicate

    @functools.wraps(original_comm)
    def communicate(self, *a, **kw):
        start = time.perf_counter()
        try:
            return original_comm(self, *a, **kw)
        finally:
            took = time.perf_counter() - start
            rec.add('p2p', took)
            if kw.get('recv_prev') and rec.step is not None and 'recv1' not in rec.step:
                rec.step['recv1'] = took

    original_step = training.train_step

    @functools.wraps(original_step)
    def train_step(*a, **kw):
        optimizer = a[3]
        if not getattr(optimizer.step, '_timed', False):
            optimizer.step = _timed(rec, 'opt', optimizer.step)
            optimizer.step._timed = True
        rec.step = {'phase': rec.phase, 't0': time.perf_counter(), 'unix0': time.time()}
        try:
            return original_step(*a, **kw)
        finally:
            rec.step['wall'] = time.perf_counter() - rec.step.pop('t0')
            rec.steps.append(rec.step)
            rec.step = None

    original_run = training.run_warmup

    snapshot_cls = state_snapshot.TrainingStateSnapshot

    @functools.wraps(original_run)
    def run_warmup(*a, **kw):
        rec.phase = 'warmup'
        try:
            with contextlib.ExitStack() as stack:
                for owner, name, key in (
                    (snapshot_cls, '__init__', 'stage'),
                    (snapshot_cls, 'restore', 'restore'),
                    (warmup, '_failed_ranks', 'sync'),
                    (gc, 'collect', 'gc'),
                ):
                    timed = _timed(rec, key, getattr(owner, name), outside=True)
                    stack.enter_context(patched(owner, name, timed))
                report = original_run(*a, **kw)
            rec.warmup_seconds = report.seconds
            return report
        finally:
            rec.phase = 'real'

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            patched(
                schedules,
                'forward_step',
                _timed(rec, 'fwd', schedules.forward_step, on_start=first_forward),
            )
        )
        stack.enter_context(
            patched(schedules, 'backward_step', _timed(rec, 'bwd', schedules.backward_step))
        )
        stack.enter_context(patched(p2p_communication.P2PCommunicator, '_communicate', communicate))
        stack.enter_context(
            patched(
                training, 'finalize_model_grads', _timed(rec, 'fin', training.finalize_model_grads)
            )
        )
        stack.enter_context(patched(training, 'train_step', train_step))
        stack.enter_context(patched(training, 'run_warmup', run_warmup))
        yield


def scenario_timing(ctx, argv, tag):
    """Harness scenario: pretrain_gpt.py with ``argv`` under the timers; per-step records."""
    from tests.scenarios.pretrain import scenario_pretrain_gpt
    from tests.scenarios.warmup import _import_training

    _import_training()
    from megatron.core import parallel_state

    rec = _Recorder()
    with _instrument(rec):
        out = scenario_pretrain_gpt(ctx, argv, tag=tag)
    return {
        'pp_rank': parallel_state.get_pipeline_model_parallel_rank(),
        'dp_rank': parallel_state.get_data_parallel_rank(),
        'exit': out.get('exit'),
        'losses_logged': len(out.get('iterations', [])),
        'warmup_seconds': rec.warmup_seconds,
        'outside_steps': rec.outside,
        'steps': rec.steps,
    }


def _ms(seconds):
    return '' if seconds is None else f'{1000 * seconds:.0f}'


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def table(runs):
    """Markdown table: one row per (layout, arm, stage of DP rank 0, step); each cell is the
    median over the repeats."""
    cols = ['wall', 'fwd', 'bwd', 'p2p', 'recv1', 'fin', 'opt', 'other', 'fwd1@']
    lines = [
        '| world:pp | arm | stage | step | ' + ' | '.join(cols) + ' |',
        '|---|---|---|---|' + '---:|' * len(cols),
    ]

    def cells(step):
        other = step['wall'] - sum(step.get(k, 0.0) for k in PHASES)
        row = [step['wall']] + [step.get(k, 0.0) for k in PHASES[:3]]
        return row + [
            step.get('recv1'),
            step.get('fin', 0.0),
            step.get('opt', 0.0),
            other,
            step.get('fwd1_at'),
        ]

    for (spec, arm), repeats in runs.items():
        for stage in sorted({r['pp_rank'] for r in repeats[0]}):
            per_repeat = [
                next(r for r in per_rank if r['pp_rank'] == stage and r['dp_rank'] == 0)
                for per_rank in repeats
            ]
            for i, step in enumerate(per_repeat[0]['steps']):
                n = sum(s['phase'] == step['phase'] for s in per_repeat[0]['steps'][: i + 1])
                columns = zip(*(cells(rep['steps'][i]) for rep in per_repeat))
                lines.append(
                    f"| {spec} | {arm} | {stage} | {step['phase']} {n} | "
                    + ' | '.join(_ms(_median(c)) for c in columns)
                    + ' |'
                )
    return '\n'.join(lines)


def main():
    """Run each layout (and arm, and repeat) in its own world; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--layout', action='append', default=None, metavar='WORLD:PP')
    parser.add_argument('--warmup-steps', type=int, default=3)
    parser.add_argument('--real-steps', type=int, default=3)
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--hidden', type=int, default=128)
    parser.add_argument('--seq', type=int, default=64)
    parser.add_argument('--micro-batch', type=int, default=2)
    parser.add_argument('--microbatches', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=1)
    parser.add_argument(
        '--no-warmup-arm',
        action='store_true',
        help='also run each layout without the warmup (its first real steps cold)',
    )
    parser.add_argument('--out', default=None, help='write the raw per-rank records as JSON')
    opts = parser.parse_args()

    sys.path.insert(0, REPO)
    from tests.harness import bases, run_world

    runs = {}
    arms = (
        {'warmup': opts.warmup_steps, 'none': 0}
        if opts.no_warmup_arm
        else {'warmup': opts.warmup_steps}
    )
    for spec in opts.layout or ['2:2', '4:4']:
        world, pp = (int(x) for x in spec.split(':'))
        for repeat in range(opts.repeats):
            for arm, steps in arms.items():  # arms interleaved, so drift hits both alike
                argv = gpt_argv(
                    pp,
                    world // pp,
                    opts.layers,
                    opts.hidden,
                    opts.seq,
                    opts.micro_batch,
                    opts.microbatches,
                    opts.real_steps,
                    steps,
                )
                call = (TARGET, {'argv': argv, 'tag': bases.upstream_ref()})
                [per_rank] = run_world(world, 'fork', [call], timeout=900)
                for rank, res in enumerate(per_rank):
                    if 'error' in res or res.get('exit') not in (None, 0):
                        raise SystemExit(
                            f'{spec} {arm} rank {rank}: ' f'{res.get("error") or res.get("exit")}'
                        )
                runs.setdefault((spec, arm), []).append(per_rank)
    print(
        f'base {bases.BASE}; ms; median of {opts.repeats} run(s); argv (last run): '
        f'{" ".join(argv)}\n'
    )
    print(table(runs))
    for (spec, arm), repeats in runs.items():
        if arm == 'warmup':
            print(f'\n{spec}: run_warmup() outside its steps, per rank (median ms):')
            for r in range(len(repeats[0])):
                parts = {'total': [rep[r]['warmup_seconds'] for rep in repeats]}
                for key in ('stage', 'sync', 'restore', 'gc'):
                    parts[key] = [rep[r]['outside_steps'].get(key) for rep in repeats]
                steps = [
                    sum(s['wall'] for s in rep[r]['steps'] if s['phase'] == 'warmup')
                    for rep in repeats
                ]
                parts['steps'] = steps
                text = ', '.join(f'{k} {_ms(_median(v))}' for k, v in parts.items())
                print(f"  rank {r} (stage {repeats[0][r]['pp_rank']}): {text}")
    if opts.out:
        with open(opts.out, 'w') as f:
            json.dump({f'{spec} {arm}': reps for (spec, arm), reps in runs.items()}, f, indent=1)


if __name__ == '__main__':
    main()
