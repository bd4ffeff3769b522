"""Candidate 8 (docs/resume.md): a distributed-optimizer checkpoint saved before the first step.

The tiny GPT of tests/driver/pretrain_tiny_gpt.py through pretrain() on 2 CPU ranks, fp16 from
the default initial loss scale (2**32, every iteration skipped), N=4, K=2: the run that never
stops, the run that saves and exits at K, the resumed run (a fresh world); prints each phase's
per-rank errors and, when the resume ran, which recorded keys differ after K.

    OMP_NUM_THREADS=1 .venv/bin/python results/resume-nostep-2026-12-05/repro.py TREE MODE

TREE: a harness tree label ('fork-0.19.2', 'pristine-dev', ...) or a directory holding
megatron/; MODE: 'fp16' (dp_reshardable) or 'fp16-fully' (--dist-ckpt-optim-fully-reshardable).
Run from the repository root.
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.getcwd())
from tests.harness.launcher import run_world  # noqa: E402
from tests.scenarios.pretrain import tiny_gpt_args  # noqa: E402

S = 'tests.scenarios.resume_e2e:scenario_resume_run'
N, K = 4, 2
ITERATION_KEYS = ('losses', 'grad_norm', 'lr', 'loss_scale')
STEP_KEYS = ('groups', 'scheduler_steps', 'model', 'optimizer')


def errors(res):
    return [r['error'][-600:] if 'error' in r else None for r in res]


def main(tree, mode):
    args = [a for a in tiny_gpt_args(2, train_iters=N) if a != '--bf16'] + ['--fp16']
    if mode == 'fp16-fully':
        args += ['--dist-ckpt-optim-fully-reshardable']
    ckpt = tempfile.mkdtemp(prefix='nostep-')
    try:
        ref = run_world(2, tree, [(S, dict(argv=args))], timeout=300)[0]
        print('reference errors', errors(ref))
        print('loss scale', [it['loss_scale'] for it in ref[0]['iterations']])
        print('grad norm', [it['grad_norm'] for it in ref[0]['iterations']])
        save = ['--save', ckpt, '--save-interval', str(K), '--exit-interval', str(K)]
        stopped = run_world(2, tree, [(S, dict(argv=args + save))], timeout=300)[0]
        print('stopped errors', errors(stopped))
        load = ['--save', ckpt, '--load', ckpt, '--save-interval', '100']
        resumed = run_world(2, tree, [(S, dict(argv=args + load))], timeout=300)[0]
        print('resumed errors', errors(resumed))
        for rank, (got, want) in enumerate(zip(resumed, ref)):
            if 'error' in got:
                continue
            g = {i['iteration']: i for i in got['iterations']}
            w = {i['iteration']: i for i in want['iterations']}
            gs = {s['iteration']: s for s in got['steps']}
            ws = {s['iteration']: s for s in want['steps']}
            for it in range(K + 1, N + 1):
                diff = [k for k in ITERATION_KEYS if g[it][k] != w[it][k]]
                diff += [k for k in STEP_KEYS if gs[it][k] != ws[it][k]]
                print('rank', rank, 'iteration', it, 'differs in', diff)
    finally:
        shutil.rmtree(ckpt, True)


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
