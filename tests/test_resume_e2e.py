"""A resumed run is the run that never stopped, through upstream's pretrain() (docs/resume.md).

Each configuration trains the tiny GPT of tests/driver/pretrain_tiny_gpt.py three times through
``pretrain()`` on CPU ranks: N iterations without stopping; again with ``--save``,
``--save-interval K`` and ``--exit-interval K`` (it saves and exits at K); and once more with
``--load`` in a world of fresh processes (it resumes at K and trains to N). After every
iteration past K, the resumed run's losses, grad norm, learning rate, loss scale, each param
group's lr/weight decay/max_lr/min_lr, the scheduler's step count, and digests of the model params
and of the optimizer (main params and every state tensor, ``step`` included) must equal the run
that never stopped, bitwise, on every rank, and so must the host random number streams (Python,
NumPy, torch CPU) right after the load and the data iterators' build. Dropout is on (0.1), so
the RNG restore is checked in the losses too.

Configurations: the distributed optimizer with dp_reshardable and fully_reshardable checkpoints,
plain DDP, bf16 with fp32 main params, fp16 with the loss scaler, one fp32 param among bf16 ones,
per-module LRs (``--decoupled-lr``), several buckets, a small MoE with expert parallelism 2 (expert
and dense params of uneven sizes), the MoE at TP 2 with sequence parallelism and EP 2, world 2 and
4; on a resume, ``--override-opt-param-scheduler`` with a new LR (the resumed LRs must equal those
of a run started with the new LR), and, on the fork, ``--warmup-train-steps``. Resharding: a DP 4
fully_reshardable checkpoint resumed at DP 2 (same global batch): the loaded model is bitwise the
saved one; the steps after it sum the gradients in another order, so they are compared with a
bound measured in the same test (the distance between the DP 2 and DP 4 runs that never
stopped).

Counterfactual: the pristine base, run through the same check, fails where a resume bug of
docs/resume.md is open on it (``PRISTINE`` below, per base); the fork passes everywhere.
``torch.optim.AdamW`` is the optimizer here (no apex or Transformer Engine), and pretrain() has
no switch for L2-mode Adam on any base (``OptimizerConfig.decoupled_weight_decay`` has no
argument): tests/test_resume_candidates.py covers ``torch.optim.Adam``.
"""

import atexit
import functools
import os
import shutil
import tempfile

import pytest

from tests.harness import bases, call
from tests.harness.launcher import default_timeout, run_world
from tests.scenarios.pretrain import tiny_gpt_args
from tests.scenarios.resume_e2e import ITERATION_KEYS, STEP_KEYS
from tests.scenarios.resume_e2e import by_iteration as _by_iteration

pytestmark = pytest.mark.same_run_bitwise
S = 'tests.scenarios.resume_e2e:scenario_resume_run'
N, K = 4, 2
FORK = bases.FORK
PRISTINE = bases.PRISTINE
CKPT_ROOT = tempfile.mkdtemp(prefix='fork-resume-e2e-')
atexit.register(shutil.rmtree, CKPT_ROOT, True)


def _args(ws, remove=(), add=(), gbs=None):
    args = [a for a in tiny_gpt_args(ws, train_iters=N) if a not in remove]
    if gbs is not None:
        args[args.index('--global-batch-size') + 1] = str(gbs)
    return args + list(add)


BF16 = ('--bf16',)
FULLY = ['--dist-ckpt-optim-fully-reshardable']
MOE = [
    '--num-experts', '4',
    '--expert-model-parallel-size', '2',
    '--moe-router-topk', '2',
    '--moe-aux-loss-coeff', '0.01',
    '--swiglu',
    '--disable-bias-linear',
]  # fmt: skip
FORCE_LB = ['--moe-router-force-load-balancing']
DISTOPT = ('--use-distributed-optimizer',)
NEW_LR = ['--lr', '5e-4', '--min-lr', '5e-5']
NO_DROPOUT = ['--hidden-dropout', '0', '--attention-dropout', '0']

# name: world size, command line, scenario kwargs. Each is trained without stopping and, unless
# 'stop' is False, stopped at K; 'pristine': whether the pristine arm runs it too.
CONFIGS = {
    # distributed optimizer, dp_reshardable, bf16 + fp32 main params, per-module LR, 4 buckets
    'distopt-dp': dict(
        ws=2, args=_args(2, add=['--decoupled-lr', '3e-3', '--ddp-bucket-size', '6000'])
    ),
    # fully_reshardable, one fp32 param among the bf16 ones
    'distopt-fully-fp32param': dict(
        ws=2, args=_args(2, add=FULLY), kw={'fp32_params': 'decoder.final_layernorm.'}
    ),
    # fp16 with the dynamic loss scaler (from 4096: no iteration before K is skipped)
    'distopt-fp16': dict(
        ws=2, args=_args(2, remove=BF16, add=['--fp16', '--initial-loss-scale', '4096'])
    ),
    # fp16 from the default loss scale (2**32): every step before K and after it is skipped,
    # so the optimizer has not stepped when it saves (change distopt-fp16-no-step-yet)
    'distopt-fp16-no-step-yet': dict(ws=2, args=_args(2, remove=BF16, add=['--fp16'])),
    # plain DDP (Float16OptimizerWithFloat16Params)
    'ddp': dict(ws=2, args=_args(2, remove=DISTOPT)),
    # MoE, EP 2, plain DDP, the router's random logits (--moe-router-force-load-balancing) drawn
    # from the expert-parallel tracker stream, which is seeded per EP rank (change
    # rng-state-per-rank); and the same with --data-parallel-random-init (the states of every DP
    # rank gathered into each checkpointed list)
    'moe-ep2-ddp': dict(ws=2, args=_args(2, remove=DISTOPT, add=MOE + FORCE_LB)),
    'moe-ep2-ddp-dprandom': dict(
        ws=2, args=_args(2, remove=DISTOPT, add=MOE + FORCE_LB + ['--data-parallel-random-init'])
    ),
    # MoE at TP 2 with sequence parallelism and EP 2 (world 4): expert and dense params in
    # separate buffers of uneven sizes; the model-parallel stream is seeded per TP rank and feeds
    # the hidden dropout under SP, the expert-parallel stream per EP rank the router's random
    # logits: each rank must resume its own (change rng-state-per-rank with TP > 1)
    'moe-tp2-ep2': dict(
        ws=4,
        args=_args(4, add=['--tensor-model-parallel-size', '2', '--sequence-parallel'])
        + MOE
        + FORCE_LB,
    ),
    # the reference of 'override': a run started with the new LR
    'distopt-dp-new-lr': dict(
        ws=2,
        args=_args(2, add=['--decoupled-lr', '3e-3', '--ddp-bucket-size', '6000'] + NEW_LR),
        stop=False,
    ),
    # world 4, fully_reshardable: resumed at DP 4 and, resharded, at DP 2 (global batch 16).
    # Without dropout: each rank's dropout stream is its own, so after resharding the same sample
    # meets another mask, and only the reduction order may differ from the DP 4 run.
    'w4-fully': dict(ws=4, args=_args(4, add=FULLY + NO_DROPOUT), kw={'full': True}),
    'w2-gbs16': dict(
        ws=2, args=_args(2, add=FULLY + NO_DROPOUT, gbs=16), kw={'full': True}, stop=False
    ),
}

# name: the resumed run: the config whose checkpoint it loads ('src'), its world and command line
# (default: the src's), the config whose uninterrupted run it must equal ('ref') and how
# ('bitwise'; 'lr': the learning rates only; 'reshard': see _check_reshard).
RESUMES = {
    name: dict(src=name, ref=name, how='bitwise')
    for name, cfg in CONFIGS.items()
    if cfg.get('stop', True)
}
RESUMES.update(
    {
        'override': dict(
            src='distopt-dp',
            args=CONFIGS['distopt-dp']['args'] + NEW_LR + ['--override-opt-param-scheduler'],
            ref='distopt-dp-new-lr',
            how='lr',
        ),
        'warmup': dict(
            src='distopt-dp',
            args=CONFIGS['distopt-dp']['args'] + ['--warmup-train-steps', '2'],
            ref='distopt-dp',
            how='bitwise',
        ),
        # A checkpoint of the pristine base (RNG states in the (PP, TP) layout) resumed by the
        # fork: it reads the older layout (change rng-state-per-rank).
        'legacy-rng-layout': dict(src='ddp', src_tree=PRISTINE, ref='ddp', how='bitwise'),
        'reshard-dp4-to-dp2': dict(
            src='w4-fully', ws=2, args=CONFIGS['w2-gbs16']['args'], ref='w4-fully', how='reshard'
        ),
    }
)
RESUMES['w4-fully']['ref'] = 'w4-fully'

# What the pristine base does, per resume (docs/resume.md): None = resumes as the run that never
# stopped, else the end of what the check reports. Candidate 5 (torch Adam's step) breaks every
# distributed-optimizer resume in a fresh process on every base: the load template's
# DistributedOptimizer.state_dict() asserts one step over the fresh, empty state (a bare assert).
# Candidate 3 (an fp32 param among bf16 ones) fails the fully_reshardable save itself. Plain DDP
# loads right, then builds the data iterators from the restored CPU generator: one draw the run
# that never stopped did not make there (change resume-host-rng-data-iterators).
RESUME_ASSERTS = 'the resumed run, rank 0: AssertionError: '
PRISTINE_RESUMES = {
    'distopt-dp': RESUME_ASSERTS,
    'distopt-fully-fp32param': (
        RESUME_ASSERTS  # dev has candidate 3's fix (ceaa6c5d7e): candidate 5 stops it later
        if bases.upstream_has('distopt-mixed-dtype-group-state')
        else 'the run stopped at K, rank 0: RuntimeError: The size of tensor a (128) must match '
        'the size of tensor b (64) at non-singleton dimension 0'
    ),
    'ddp': "RNG differs after the load and the iterators (rank 0: ['torch']; rank 1: ['torch'])",
    # Every DP x CP rank restores DP x CP rank 0's states: EP rank 1 gets EP rank 0's
    # expert-parallel stream (change rng-state-per-rank) besides the iterators' draws.
    'moe-ep2-ddp': (
        "RNG differs after the load and the iterators (rank 0: ['torch']; "
        "rank 1: ['torch', 'tracker:expert-parallel-rng'])"
    ),
}


def _ckpt_dir(tree, name):
    return os.path.join(CKPT_ROOT, tree, name)


def _save_args(tree, name):
    return ['--save', _ckpt_dir(tree, name), '--save-interval', str(K), '--exit-interval', str(K)]


def _resume_spec(name):
    spec = dict(RESUMES[name])
    src = CONFIGS[spec['src']]
    spec.setdefault('ws', src['ws'])
    spec.setdefault('args', src['args'])
    spec.setdefault('kw', src.get('kw', {}))
    return spec


# The fork runs everything; the pristine arm the resumes of PRISTINE_RESUMES and their configs.
RESUMES_OF = {FORK: list(RESUMES), PRISTINE: list(PRISTINE_RESUMES)}
CONFIGS_OF = {
    FORK: list(CONFIGS),
    PRISTINE: sorted({RESUMES[n][k] for n in PRISTINE_RESUMES for k in ('src', 'ref')}),
}

UNSTOPPED = {}
STOPPED = {}
for _tree, _names in CONFIGS_OF.items():
    for _name in _names:
        _cfg = CONFIGS[_name]
        _kw = _cfg.get('kw', {})
        UNSTOPPED[(_tree, _name)] = call(
            _cfg['ws'], _tree, S, argv=_cfg['args'], timeout=120, **_kw
        )
        if _cfg.get('stop', True):
            _argv = _cfg['args'] + _save_args(_tree, _name)
            STOPPED[(_tree, _name)] = call(_cfg['ws'], _tree, S, argv=_argv, timeout=120, **_kw)


@functools.lru_cache(maxsize=None)
def _resumed(tree, ws):
    """Every resume of this tree and world size, in one world of fresh processes."""
    names = [n for n in RESUMES_OF[tree] if _resume_spec(n)['ws'] == ws]
    for name in names:  # the checkpoints must exist first
        spec = _resume_spec(name)
        STOPPED[(spec.get('src_tree', tree), spec['src'])].result()
    calls = []
    for name in names:
        spec = _resume_spec(name)
        ckpt = _ckpt_dir(spec.get('src_tree', tree), spec['src'])
        argv = spec['args'] + ['--load', ckpt]  # no --save: another resume reads it too
        calls.append((S, dict(argv=argv, **spec['kw'])))
    results = run_world(ws, tree, calls, timeout=default_timeout(len(calls)) + 120 * len(calls))
    return dict(zip(names, results))


class RunFailed(Exception):
    """A run of the check raised or exited non-zero on some rank."""


def _ok(per_rank, what):
    for rank, res in enumerate(per_rank):
        if 'error' in res:
            raise RunFailed(f'{what}, rank {rank}: {res["error"]}')
        if res['exit'] not in (None, 0):
            raise RunFailed(f'{what}, rank {rank}: exit {res["exit"]}')
    return per_rank


def _first_difference(resumed, reference, keys):
    """The first (iteration, key) where the resumed run leaves the reference, else None."""
    ref = _by_iteration(reference)
    got = _by_iteration(resumed)
    if sorted(got) != list(range(K + 1, N + 1)):
        return 'iterations', sorted(got)
    for iteration in range(K + 1, N + 1):
        for key in keys:
            if got[iteration][key] != ref[iteration][key]:
                return iteration, key
    return None


def _check(tree, name):
    """What the resume check says: None (passes) or the first way it fails."""
    spec = _resume_spec(name)
    try:
        src = (spec.get('src_tree', tree), spec['src'])
        stopped = _ok(STOPPED[src].result(), f'{name}: the run stopped at K')
        resumed = _ok(_resumed(tree, spec['ws'])[name], f'{name}: the resumed run')
    except RunFailed as exc:
        return str(exc)
    reference = _ok(UNSTOPPED[(tree, spec['ref'])].result(), f'{name}: the reference')
    for res in stopped:
        assert [it['iteration'] for it in res['iterations']] == list(range(1, K + 1))
    if spec['how'] == 'reshard':
        return _check_reshard(tree, stopped, resumed, reference)
    keys = ('lr', 'groups', 'scheduler_steps') if spec['how'] == 'lr' else None
    if keys is None:
        for rank, (got, saved) in enumerate(zip(resumed, stopped)):
            if got['start']['model'] != _by_iteration(saved)[K]['model']:
                return f'model differs after the load (rank {rank})'
        moved = []
        for rank, (got, ref) in enumerate(zip(resumed, reference)):
            want = _by_iteration(ref)[K]['rng']
            streams = [s for s in sorted(want) if got['start']['rng'][s] != want[s]]
            if streams:
                moved.append(f'rank {rank}: {streams}')
        if moved:
            return f'RNG differs after the load and the iterators ({"; ".join(moved)})'

    for rank, (got, ref) in enumerate(zip(resumed, reference)):
        diff = _first_difference(got, ref, keys or ITERATION_KEYS + STEP_KEYS)
        if diff:
            what = 'lr' if keys else ('optimizer' if diff[1] == 'optimizer' else diff[1])
            return f'{what} differs (rank {rank}, iteration {diff[0]}, {diff[1]})'
    return None


def _max_distance(a, b):
    """Largest |a - b| over every param element, and over the losses, of two full records."""
    params = max(
        abs(float.fromhex(x) - float.fromhex(y))
        for name in a['params']
        for x, y in zip(a['params'][name], b['params'][name])
    )
    loss = abs(float.fromhex(a['losses']['lm loss'][0]) - float.fromhex(b['losses']['lm loss'][0]))
    return params, loss


def _check_reshard(tree, stopped, resumed, dp4):
    """DP 4 -> DP 2: the loaded model is bitwise the saved one; the steps after it lie within
    the distance that the reduction order alone puts between DP 2 and DP 4 (measured here)."""
    dp2 = _ok(UNSTOPPED[(tree, 'w2-gbs16')].result(), 'reshard: the DP 2 run')
    saved = _by_iteration(stopped[0])[K]['params']
    for rank, res in enumerate(resumed):
        if res['start']['params'] != saved:
            return f'reshard: the model after the load differs from the saved one (rank {rank})'
        if [s['iteration'] for s in res['steps']] != list(range(K + 1, N + 1)):
            return f'reshard: rank {rank} ran iterations {[s["iteration"] for s in res["steps"]]}'
    # The bound: the largest distance between the DP 2 and DP 4 runs that never stopped (they sum
    # in different orders from iteration 1 on; the resharded run only after K).
    after = range(K + 1, N + 1)
    noise = [_max_distance(_by_iteration(dp2[0])[i], _by_iteration(dp4[0])[i]) for i in after]
    bound = [max(n[q] for n in noise) for q in (0, 1)]
    for iteration in after:
        got = _max_distance(_by_iteration(resumed[0])[iteration], _by_iteration(dp4[0])[iteration])
        for what, g, b in zip(('params', 'loss'), got, bound):
            if g > b:
                return f'reshard: {what} off by {g} at iteration {iteration} (bound {b})'
    return None


RESUME_NAMES = list(RESUMES)


@pytest.mark.parametrize('name', RESUME_NAMES)
def test_fork_resume_is_the_run_that_never_stopped(name):
    assert _check(FORK, name) is None


@pytest.mark.parametrize('name', sorted(PRISTINE_RESUMES))
def test_pristine_resume(name):
    expected = PRISTINE_RESUMES[name]
    got = _check(PRISTINE, name)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.endswith(expected), got
