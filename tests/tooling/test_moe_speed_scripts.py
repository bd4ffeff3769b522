"""The issue 38 GPU scripts, checked without a GPU.

- tools/maint/gpu_moe_speed.sh with a stand-in ``python3`` on PATH that records what it was
  started with: each arm runs its tree (pristine and eager the pristine tree, eager with
  TORCHDYNAMO_DISABLE=1, fork-warmup5 with ``--warmup-train-steps 5``), every run logs dynamo's
  recompiles, the models pass their expert layouts, and DEADLINE names the runs it left out.
- tools/maint/moe_act_microbench.py on CPU ranks' trees (small ffn): the fork holds at most two
  graphs of each weighted SwiGLU function after steps of changing per-expert counts, pristine
  more.
- tools/maint/moe_step_bench.py: its switch between compiled and Python functions, on CPU.
- tools/maint/trace_summary.py on a made-up chrome trace: the steps' wall and GPU busy time (the
  union of overlapping kernels), the launches per step, the tables per step, and exit code 2
  with one line for an unreadable trace or one without a profiled step. gpu_moe_speed.sh's
  fork-eager arm and PROFILE option.
- tools/maint/step_probe (a sitecustomize): megatron's train_step and the data iterator wrapped as
  they are imported, one line per step; gpu_moe_speed.sh's PROBE option.
"""

import gzip
import json
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


def test_gpu_moe_speed_gc_probe(tmp_path):
    """GC_PROBE=1 puts tools/maint/gc_probe/ after the tree on PYTHONPATH; without it, nothing."""
    probe = REPO / 'tools' / 'maint' / 'gc_probe'
    for flag, expected in (('1', f':{probe} '), ('0', ' ')):
        run, trees = _speed(tmp_path, MODELS='ag8', ARMS='fork', TAG='g', GC_PROBE=flag)
        assert run.returncode == 0, run.stderr
        env_line = (tmp_path / 'logs' / 'ag8-fork-g1.log').read_text().splitlines()[0]
        assert f'PYTHONPATH={trees["fork"]}{expected}' in env_line, env_line


def test_gpu_moe_speed_probe_dir(tmp_path):
    """PROBE=DIR puts DIR before the tree on PYTHONPATH (its sitecustomize wins), with or without
    GC_PROBE; without PROBE the tree comes first."""
    probe = tmp_path / 'probe'
    probe.mkdir()
    for gc_flag in ('0', '1'):
        run, trees = _speed(
            tmp_path, MODELS='ag8', ARMS='fork', TAG='p', PROBE=str(probe), GC_PROBE=gc_flag
        )
        assert run.returncode == 0, run.stderr
        env_line = (tmp_path / 'logs' / 'ag8-fork-p1.log').read_text().splitlines()[0]
        assert f'PYTHONPATH={probe.resolve()}:{trees["fork"]}' in env_line, env_line
    run, trees = _speed(tmp_path, MODELS='ag8', ARMS='fork', TAG='p')
    env_line = (tmp_path / 'logs' / 'ag8-fork-p1.log').read_text().splitlines()[0]
    assert f'PYTHONPATH={trees["fork"]} ' in env_line, env_line


def test_gc_probe_reports_collections():
    """The probe, imported as sitecustomize by a plain interpreter: a full collection's line as it
    ends, the totals at exit, and the program's own output untouched."""
    run = subprocess.run(
        [sys.executable, '-c', 'import gc; gc.collect(); print("done")'],
        env=dict(os.environ, PYTHONPATH=str(REPO / 'tools' / 'maint' / 'gc_probe')),
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0 and run.stdout == 'done\n', run
    assert re.search(r'^\[gc\] gen2 [\d.]+ ms collected \d+$', run.stderr, re.M), run.stderr
    totals = r'^\[gc\] totals gen0: \d+ in \d+ ms gen1: .* gen2: [1-9]\d* in'
    assert re.search(totals, run.stderr, re.M), run.stderr


STEP_PROBE_CHECK = """
import gc, re, sys
import sitecustomize as probe
import megatron.training.training as training
import megatron.core.rerun_state_machine as rerun
assert getattr(training.train_step, 'step_probe', False), training.train_step
assert getattr(rerun.RerunDataIterator.__next__, 'step_probe', False)
assert next(rerun.RerunDataIterator(iter([7]))) == 7
lines = []
step = probe.wrap_train_step(lambda n: (gc.collect(), 2 * n)[1], freeze_at=2, write=lines.append)
assert step(3) == 6 and step(4) == 8
sys.stdout.write(''.join(lines))
lines, slept = [], []
def work(n):
    return sorted(range(n, 0, -1))[0]
sleep = probe.time.sleep
probe.time.sleep = lambda seconds: (slept.append(seconds), sleep(seconds))
step = probe.wrap_train_step(work, write=lines.append, pause=(2, 200), profile_calls={2})
assert step(5) == 1 and step(6) == 1 and step(7) == 1
probe.time.sleep = sleep
assert slept == [0.2], slept  # once, before call 2
sys.stdout.write(''.join(lines))
"""


def test_step_probe_wraps_train_step():
    """The step probe, imported as sitecustomize: megatron's train_step and the data iterator's
    __next__ wrapped as their modules are imported (the originals run), one line per call with a
    full collection counted, gc.freeze() before the call PROBE_FREEZE_AT names, the pause of
    PROBE_PAUSE in its call's gap, and cProfile's lines after the calls PROBE_PROFILE names."""
    run = subprocess.run(
        [sys.executable, '-c', STEP_PROBE_CHECK],
        env=dict(os.environ, PYTHONPATH=str(REPO / 'tools' / 'maint' / 'step_probe')),
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO / 'tools',  # not the repository root: its megatron/ is the materialized tree
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    fields = r'step_ms [\d.]+ gap_ms {} data_ms [\d.]+ gc_ms [\d.]+ gc2 1 mallocs \d+ '
    assert re.match(r'\[probe\] call 1 ' + fields.format('nan'), lines[0]), lines[0]
    assert re.match(r'\[probe\] gc.freeze\(\) before call 2: \d+$', lines[1]), lines[1]
    assert re.match(r'\[probe\] call 2 ' + fields.format(r'[\d.]+'), lines[2]), lines[2]
    # PROBE_PAUSE and PROBE_PROFILE: the pause lands in call 2's gap, only call 2 is profiled
    calls = [re.match(r'\[probe\] call (\d) .* gap_ms ([\d.na]+) ', ln) for ln in lines[3:]]
    calls = [m for m in calls if m]
    assert [m[1] for m in calls] == ['1', '2', '3'], lines
    assert float(calls[1][2]) >= 200, lines  # the pause is inside call 2's gap
    prof = [ln for ln in lines[3:] if ln.startswith('[probe-prof')]
    assert prof and all(ln.startswith('[probe-prof 2] ') for ln in prof), lines
    assert any(ln.endswith(':work') for ln in prof) and any('sorted' in ln for ln in prof), prof
    assert lines[3:].index(prof[0]) == 2  # right after call 2's line


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
    """The fork: at most two graphs of each direction (a probs slice at storage offset 0 and one
    at a symbolic offset); pristine: more, one for each kind of count it met."""
    fork, pristine = (resolve_tree(t)[1] for t in (bases.FORK, bases.PRISTINE))
    held_fork = _bench(fork)
    assert 2 <= held_fork <= 4, held_fork
    held = _bench(pristine)
    if bases.tree_has_fix(bases.PRISTINE, 'moe-routed-token-count-dynamic'):
        assert held == held_fork
    else:
        assert held > 4, held


def test_gpu_moe_speed_fork_eager_and_profile(tmp_path):
    run, trees = _speed(tmp_path, MODELS='ag8', ARMS='fork-eager', TAG='p', PROFILE='19:23')
    assert run.returncode == 0, run.stderr
    logs = tmp_path / 'logs'
    env_line, args_line = (logs / 'ag8-fork-eager-p1.log').read_text().splitlines()[:2]
    assert f"PYTHONPATH={trees['fork']} " in env_line and 'TORCHDYNAMO_DISABLE=1 ' in env_line
    assert '--profile --use-pytorch-profiler --profile-step-start 19 --profile-step-end 23' in (
        args_line
    )
    assert f"--tensorboard-dir {logs / 'ag8-fork-eager-p1.prof'}/tb" in args_line
    # after the run, the trace's summary: the stand-in python3 records that command line too
    summary = (logs / 'ag8-fork-eager-p1.trace.txt').read_text()
    assert 'trace_summary.py' in summary, summary
    assert f"{logs / 'ag8-fork-eager-p1.prof'}/torch_profile/rank-0.json.gz" in summary


def _x(name, cat, ts, dur):
    return {'ph': 'X', 'name': name, 'cat': cat, 'ts': ts, 'dur': dur, 'pid': 0, 'tid': 0}


def test_trace_summary(tmp_path):
    events = [
        _x('ProfilerStep#5', 'user_annotation', 0, 1000),
        _x('ProfilerStep#5', 'gpu_user_annotation', 0, 1000),  # the GPU copy: not a step
        _x('ProfilerStep#6', 'user_annotation', 1000, 2000),
        _x('k1', 'kernel', 100, 200),  # 100-300
        _x('k2', 'kernel', 250, 100),  # overlaps k1: busy 100-350
        _x('Memcpy DtoD', 'gpu_memcpy', 900, 200),  # clipped at the step's end: 100 in step 5
        _x('k1', 'kernel', 1500, 300),
        _x('cudaLaunchKernel', 'cuda_runtime', 90, 5),
        _x('cudaLaunchKernel', 'cuda_runtime', 240, 5),
        _x('cuLaunchKernel', 'cuda_driver', 1400, 5),
        _x('cudaStreamSynchronize', 'cuda_runtime', 600, 50),
        _x('Torch-Compiled Region: 1/2', 'cpu_op', 80, 400),
        _x('aten::mm', 'cpu_op', 1200, 100),
    ]
    trace = tmp_path / 'rank-0.json.gz'
    with gzip.open(trace, 'wt') as f:
        json.dump({'traceEvents': events}, f)
    run = subprocess.run(
        [sys.executable, str(REPO / 'tools' / 'maint' / 'trace_summary.py'), str(trace)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[2:4] == [
        'ProfilerStep#5 | 1.00 | 0.35 | 0.35 | 2',
        'ProfilerStep#6 | 2.00 | 0.40 | 0.20 | 1',
    ]
    text = run.stdout
    # per step: k1 (200 + 300) / 2 steps, 2 calls / 2 steps
    assert '      0.250      1.0  k1' in text
    assert '      0.025      0.5  cudaStreamSynchronize' in text
    compiled = text.split('CPU: compiled regions')[1]
    assert '      0.200      0.5  Torch-Compiled Region: 1/2' in compiled
    assert 'aten::mm' not in compiled


def test_trace_summary_bad_input(tmp_path):
    empty = tmp_path / 'empty.json'
    empty.write_text(json.dumps({'traceEvents': [_x('k1', 'kernel', 0, 5)]}))
    broken = tmp_path / 'broken.json.gz'
    broken.write_text('not gzip')
    for path, words in ((empty, 'no ProfilerStep#'), (broken, 'cannot read the trace')):
        run = subprocess.run(
            [sys.executable, str(REPO / 'tools' / 'maint' / 'trace_summary.py'), str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 2
        assert len(run.stderr.splitlines()) == 1 and words in run.stderr, run.stderr


STEP_BENCH = REPO / 'tools' / 'maint' / 'moe_step_bench.py'
SWITCH_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import moe_step_bench as b
from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401  (imports the fused functions)
try:  # the fork runs small forward calls eagerly: compile them here
    from megatron.core.fusions import routed_token_fuser
    routed_token_fuser.SMALL_ELEMENTS = 0
except ImportError:
    pass
from megatron.core.transformer.moe import router  # noqa: F401
from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu
names = b._switch_all()
for needed in ('bias_dropout_add_fused_train', 'weighted_swiglu', 'weighted_swiglu_back',
               'TopKRouter._apply_expert_bias'):
    assert needed in names, (needed, names)
from torch._dynamo.utils import counters
y, w = torch.randn(5, 8), torch.rand(5, 1)
b._EAGER.update(names)
eager = fused_bias_swiglu.weighted_swiglu(y, w)
assert counters['stats']['unique_graphs'] == 0, 'the eager arm entered dynamo'
b._EAGER.clear()
compiled = fused_bias_swiglu.weighted_swiglu(y, w)
assert counters['stats']['unique_graphs'] >= 1, 'the compiled arm did not compile'
assert torch.allclose(eager, compiled, rtol=1e-5, atol=1e-6)
print('switch ok', len(names))
"""


def test_moe_step_bench_switches_every_compiled_function():
    """tools/maint/moe_step_bench.py's arms: every jit_fuser function megatron holds (module
    globals and class members, the fork's routed wrappers too) is replaced by a switch; the
    eager side never enters dynamo, the compiled side compiles, and both compute the same."""
    for tree in ('fork', bases.PRISTINE):
        run = subprocess.run(
            [sys.executable, '-c', SWITCH_CHECK, str(STEP_BENCH.parent)],
            env=dict(os.environ, PYTHONPATH=str(resolve_tree(tree))),
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 0 and 'switch ok' in run.stdout, (tree, run.stderr[-2000:])
