"""The issue 38 GPU scripts, checked without a GPU.

- tools/maint/gpu_moe_speed.sh with a stand-in ``python3`` on PATH that records what it was
  started with: each arm runs its tree (pristine and eager the pristine tree, eager with
  TORCHDYNAMO_DISABLE=1, fork-warmup5 with ``--warmup-train-steps 5``), every run logs dynamo's
  recompiles, the models pass their expert layouts, and DEADLINE names the runs it left out.
- tools/maint/moe_act_microbench.py on CPU ranks' trees (small ffn): the fork holds one graph of
  each weighted SwiGLU function after steps of changing per-expert counts, pristine more.
"""

import os
import pathlib
import re
import stat
import subprocess
import sys

from tests.harness import bases
from tests.harness.launcher import resolve_tree

REPO = pathlib.Path(__file__).resolve().parents[2]
SPEED = REPO / 'tools' / 'maint' / 'gpu_moe_speed.sh'
BENCH = REPO / 'tools' / 'maint' / 'moe_act_microbench.py'
STUB = """#!/usr/bin/env bash
{ echo "PYTHONPATH=$PYTHONPATH TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-} \
TORCH_LOGS=${TORCH_LOGS:-}"; echo "ARGS $*"; } >&2
echo ' iteration        1/      30 | elapsed time per iteration (ms): 9.0 |'
"""


def _speed(tmp_path, **env):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / 'python3').write_text(STUB)
    (bin_dir / 'python3').chmod(stat.S_IRWXU)
    trees = {name: tmp_path / name for name in ('fork', 'pristine', 'mlm')}
    for path in trees.values():
        path.mkdir(exist_ok=True)
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / 'logs'))
    full_env.update(env)
    run = subprocess.run(
        ['bash', str(SPEED), *(str(trees[n]) for n in ('fork', 'pristine', 'mlm')), '1'],
        env=full_env,
        capture_output=True,
        text=True,
        check=False,
    )
    return run, trees


def test_gpu_moe_speed_arms(tmp_path):
    run, trees = _speed(
        tmp_path, MODELS='ag8 a2a4 dense', ARMS='pristine eager fork fork-warmup5', TAG='t'
    )
    assert run.returncode == 0, run.stderr
    logs = {p.name: p.read_text() for p in (tmp_path / 'logs').iterdir()}
    assert len(logs) == 12, sorted(logs)
    for name, text in logs.items():
        model, arm = re.match(r'(\w+)-(.+)-t1\.log$', name).groups()
        env_line, args_line = text.splitlines()[:2]
        tree = trees['pristine'] if arm in ('pristine', 'eager') else trees['fork']
        assert f'PYTHONPATH={tree} ' in env_line, (name, env_line)
        assert ('TORCHDYNAMO_DISABLE=1 ' in env_line) == (arm == 'eager'), env_line
        assert 'TORCH_LOGS=recompiles' in env_line
        assert ('--warmup-train-steps 5' in args_line) == (arm == 'fork-warmup5'), args_line
        assert '--train-iters 30 ' in args_line and 'pretrain_gpt.py' in args_line
        experts = {'ag8': '8', 'a2a4': '4', 'dense': None}[model]
        if experts is None:
            assert '--num-experts' not in args_line
        else:
            dispatcher = 'allgather' if model.startswith('ag') else 'alltoall'
            assert f'--num-experts {experts} ' in args_line
            assert f'--moe-token-dispatcher-type {dispatcher}' in args_line


def test_gpu_moe_speed_deadline(tmp_path):
    run, _ = _speed(tmp_path, MODELS='ag8', ARMS='pristine fork', DEADLINE='1')
    assert run.returncode == 0
    assert run.stdout.splitlines() == [
        '== ag8 pristine 1: not run (DEADLINE)',
        '== ag8 fork 1: not run (DEADLINE)',
    ]


def _bench(tree):
    run = subprocess.run(
        [sys.executable, str(BENCH), '--device', 'cpu', '--tokens', '64', '--steps', '22'],
        env=dict(os.environ, PYTHONPATH=str(tree), MOE_BENCH_FFN='16'),
        cwd=str(REPO / 'tools'),  # not the repository root: its megatron/ would shadow the tree
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return int(re.search(r'graphs held (\d+)', run.stdout)[1])


def test_microbench_graphs_held():
    fork, pristine = (resolve_tree(t)[1] for t in (bases.FORK, bases.PRISTINE))
    assert _bench(fork) == 2
    held = _bench(pristine)
    assert (
        held == 2
        if bases.tree_has_fix(bases.PRISTINE, 'moe-routed-token-count-dynamic')
        else (held > 2)
    ), held
