"""Issue 30, candidates 1-6: what pristine upstream does on resume (CPU ranks, gloo).

Every case goes through the real save/load path (``tests/scenarios/resume_candidates.py``):
``get_megatron_optimizer`` with the distributed optimizer, ``sharded_state_dict``,
``dist_checkpointing.save``/``load``, ``load_state_dict`` and, for candidates 1-2, the
``OptimizerParamScheduler``'s ``state_dict``/``load_state_dict`` in ``load_checkpoint``'s order.
The expectations are today's pristine behaviour per base; every comparison is against the other
arm of the same run (the run that never stopped, or a run built with the resume arguments from the
start), never a number measured once.
"""

from tests.harness import call
from tests.harness.bases import BASE, FORK, PRISTINE, upstream_has

SCHED = 'tests.scenarios.resume_candidates:scenario_scheduler'
ROUND = 'tests.scenarios.resume_candidates:scenario_round_trips'
DP, FR, FS = 'dp_reshardable', 'fully_reshardable', 'fully_sharded_model_space'

# Where upstream already has the fix (the base contains the upstream commit).
FIXED = {
    # 232c478d43 (PR 5213): override mode restores the per-group max_lr/min_lr/start_wd/end_wd.
    'override-scheduler': BASE == 'dev',
    # 27e312ca10 (PR 4705): every ParamGroupOverride key identifies a param group on load.
    'group-identifier': BASE == '0.19.2',
    # ceaa6c5d7e (PR 5835): group-order map rebuilt for mixed fp32/16-bit groups; load copies
    # under no_grad.
    'mixed-dtype': upstream_has('distopt-mixed-dtype-group-state'),
}

# Three plain params; p.1 gets a per-module override in the group-collision cases.
SMALL = dict(sizes=[40, 24, 8], bucket_size=None, dtype='bf16', steps=3)
P0, P1 = '*.p.0', '*.p.1'
# A weight decay that grows (the scheduler's default 'constant' asserts start_wd == end_wd).
LINEAR_WD = dict(start_wd=0.01, end_wd=0.02, wd_incr_style='linear')

SCHED_CASES = [
    # 1: a new --lr with --override-opt-param-scheduler on resume.
    dict(name='c1_override_new_lr', sharding=DP, resume_lr=5e-3, override_flag=True, **SMALL),
    # 1: the same with a per-module LR override whose value changes on resume.
    dict(
        name='c1_override_new_group_lr',
        sharding=DP,
        resume_lr=5e-3,
        override_flag=True,
        overrides=[(P1, {'max_lr': 2e-2, 'min_lr': 2e-3})],
        resume_overrides=[(P1, {'max_lr': 4e-3, 'min_lr': 4e-4})],
        **SMALL,
    ),
    # 1: the resume adds a per-module LR override (a group the checkpoint does not have). The
    # saving run's override matches no param: config_overrides that is not None keeps weight
    # decay on 1-D params in both runs (wd_mult 1.0), so only the LR bounds differ.
    dict(
        name='c1_override_added_group',
        sharding=DP,
        resume_lr=5e-3,
        override_flag=True,
        overrides=[('*.none', {'max_lr': 1e-2})],
        resume_overrides=[(P1, {'max_lr': 4e-3, 'min_lr': 4e-4})],
        **SMALL,
    ),
    # 1 without the flag: new per-group LRs, the checkpoint's schedule kept (each group its own).
    dict(
        name='c1_new_group_lr_checkpoint',
        sharding=DP,
        resume_lr=5e-3,
        overrides=[(P1, {'max_lr': 2e-2, 'min_lr': 2e-3})],
        resume_overrides=[(P1, {'max_lr': 4e-3, 'min_lr': 4e-4})],
        **SMALL,
    ),
    # 1: a per-module weight-decay override changed on resume (the WD half of the bounds).
    dict(
        name='c1_override_new_group_wd',
        sharding=DP,
        override_flag=True,
        overrides=[(P1, {'start_wd': 0.1, 'end_wd': 0.1})],
        resume_overrides=[(P1, {'start_wd': 0.2, 'end_wd': 0.2})],
        **SMALL,
    ),
    # 1: the resume drops the WD part of a per-module override and keeps its LR part: the group
    # takes the scheduler's weight decay, as in a run built with the new arguments.
    dict(
        name='c1_override_dropped_group_wd',
        sharding=DP,
        override_flag=True,
        overrides=[(P1, {'max_lr': 2e-2, 'min_lr': 2e-3, 'start_wd': 0.1, 'end_wd': 0.1})],
        resume_overrides=[(P1, {'max_lr': 2e-2, 'min_lr': 2e-3})],
        **SMALL,
    ),
    # 1 without the flag: a new class weight decay (--start/--end-weight-decay); the checkpoint's
    # schedule is kept from the first step after the load on. (An override that matches no param
    # keeps weight decay on the 1-D params, in one group.)
    dict(
        name='c1_new_wd_checkpoint',
        sharding=DP,
        overrides=[('*.none', {'max_lr': 1e-2})],
        resume_overrides=[('*.none', {'max_lr': 1e-2})],
        resume_schedule=dict(start_wd=0.02, end_wd=0.02),
        **SMALL,
    ),
    # 1: two per-module overrides change so that their groups swap places (groups are built in
    # the order of their override values): saved [default, p.0, p.1], resumed [default, p.1,
    # p.0]. Which saved group was whose cannot be told: refused, with or without the flag.
    dict(
        name='c1_group_order_swaps_checkpoint',
        sharding=DP,
        overrides=[(P0, {'max_lr': 2e-2, 'min_lr': 2e-3}), (P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        resume_overrides=[
            (P0, {'max_lr': 6e-3, 'min_lr': 6e-4}),
            (P1, {'max_lr': 4e-3, 'min_lr': 4e-4}),
        ],
        **SMALL,
    ),
    dict(
        name='c1_override_group_order_swaps',
        sharding=DP,
        override_flag=True,
        overrides=[(P0, {'max_lr': 2e-2, 'min_lr': 2e-3}), (P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        resume_overrides=[
            (P0, {'max_lr': 6e-3, 'min_lr': 6e-4}),
            (P1, {'max_lr': 4e-3, 'min_lr': 4e-4}),
        ],
        **SMALL,
    ),
    # 1: fewer current groups than saved ones under one old identifier (p.1's override dropped,
    # the other two groups changed): refused, not paired by position.
    dict(
        name='c1_override_fewer_groups',
        sharding=DP,
        resume_lr=5e-3,
        override_flag=True,
        overrides=[(P0, {'max_lr': 2e-2, 'min_lr': 2e-3}), (P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        resume_overrides=[(P0, {'max_lr': 6e-3, 'min_lr': 6e-4})],
        **SMALL,
    ),
    # 2: groups that differ only in max_lr/min_lr (resume with unchanged arguments).
    dict(
        name='c2_group_lr',
        sharding=DP,
        overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        resume_overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        **SMALL,
    ),
    dict(
        name='c2_group_lr_fr',
        sharding=FR,
        overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        resume_overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        **SMALL,
    ),
    # 2: groups that differ only in start_wd/end_wd.
    dict(
        name='c2_group_wd',
        sharding=DP,
        overrides=[(P1, {'start_wd': 0.1, 'end_wd': 0.1})],
        resume_overrides=[(P1, {'start_wd': 0.1, 'end_wd': 0.1})],
        **SMALL,
    ),
    # 2: groups that differ only in min_lr, or only in start_wd (a growing weight decay).
    dict(
        name='c2_group_min_lr',
        sharding=DP,
        overrides=[(P1, {'min_lr': 3e-3})],
        resume_overrides=[(P1, {'min_lr': 3e-3})],
        **SMALL,
    ),
    dict(
        name='c2_group_start_wd',
        sharding=DP,
        schedule=LINEAR_WD,
        overrides=[(P1, {'start_wd': 0.0})],
        resume_overrides=[(P1, {'start_wd': 0.0})],
        **SMALL,
    ),
]
# The fork refuses these loads (KeyError of the first group it cannot pair).
SCHED_REFUSED = (
    'c1_group_order_swaps_checkpoint',
    'c1_override_group_order_swaps',
    'c1_override_fewer_groups',
)

# 3: one fp32 param between two bf16 params, all in one param group (the bf16 buffer comes
# first, so the group-order map built over the buffers disagrees with the installed order
# [fp32 shards, fp32 copies of bf16 shards]).
MIXED = dict(sizes=[150, 100, 90], dtypes=['bf16', 'fp32', 'bf16'], dtype='bf16', bucket_size=None)
# Buffer order: bf16 [p.2 at 0, p.0 at 64] (128), fp32 [p.1] (128): at world 2 each rank holds
# 64 elements of one bf16 param and 64 of the fp32 one.
SAME_SIZE = dict(
    sizes=[64, 128, 64], dtypes=['bf16', 'fp32', 'bf16'], dtype='bf16', bucket_size=None, steps=2
)
# 6: one large param and five small ones: rank 0's shard lies inside the large one (1 entry),
# the last rank's shard spans the small ones.
UNEVEN = dict(sizes=[3, 5, 7, 2, 9, 1000], dtype='bf16', bucket_size=None)
TORCH = dict(sizes=[70, 130, 90], dtype='bf16', bucket_size=None, steps=3)

ROUND_W2 = [
    dict(name='c3_mixed_dp', sharding=DP, steps=2, **MIXED),
    dict(name='c3_mixed_fs', sharding=FS, steps=2, **MIXED),
    # 3, silent: every rank's pieces of the fp32 param and of its bf16 param have one size, so the
    # stale map swaps their state without a size error.
    dict(name='c3_same_size_dp', sharding=DP, check_content=True, **SAME_SIZE),
    dict(name='c3_same_size_fr', sharding=FR, check_content=True, **SAME_SIZE),
    dict(
        name='c3_fp32_dp',
        sharding=DP,
        steps=2,
        sizes=[150, 100, 90],
        dtype='fp32',
        bucket_size=None,
    ),
    # 5: the FusedAdam layout (control) and torch's Adam/AdamW, fresh and stepped loads.
    dict(name='c5_fused_dp_fresh', sharding=DP, adam='fused', check_content=True, **TORCH),
    dict(name='c5_fused_fr_fresh', sharding=FR, adam='fused', check_content=True, **TORCH),
    dict(name='c5_adam_dp_fresh', sharding=DP, adam='torch', **TORCH),
    dict(name='c5_adam_fr_fresh', sharding=FR, adam='torch', **TORCH),
    dict(name='c5_adam_dp_stepped', sharding=DP, adam='torch', load_steps=1, **TORCH),
    dict(name='c5_adamw_dp_stepped', sharding=DP, adam='torch_w', load_steps=1, **TORCH),
    dict(name='c5_adam_fr_stepped', sharding=FR, adam='torch', load_steps=1, **TORCH),
    dict(name='c5_adamw_fr_stepped', sharding=FR, adam='torch_w', load_steps=1, **TORCH),
    # 5 (0042): saved before the first step; the saving process trains on (its next step is its
    # first real one), and so does the resumed one.
    dict(name='c5_adam_dp_never', sharding=DP, adam='torch', **dict(TORCH, steps=0)),
    dict(name='c5_adam_fr_never', sharding=FR, adam='torch', **dict(TORCH, steps=0)),
    # 6: uneven params, dp_reshardable, one optimizer and a chained (dense + expert) one.
    dict(name='c6_uneven_dp', sharding=DP, steps=2, **UNEVEN),
    dict(name='c6_uneven_dp_torch', sharding=DP, steps=2, adam='torch', load_steps=1, **UNEVEN),
    dict(
        name='c6_uneven_chained',
        sharding=DP,
        steps=2,
        sizes=[3, 5, 7, 2, 9, 1000, 6, 700],
        expert=[6, 7],
        dtype='bf16',
        bucket_size=None,
    ),
    # 3, last (a failing save may leave the world less tidy): fully_reshardable.
    dict(name='c3_mixed_fr', sharding=FR, steps=2, **MIXED),
]

ROUND_W4 = [
    # 4: params [1, 64] in buffer order: 1 element at 0, the next param starts at 64 (aligned);
    # the 128-element bucket gives each of 4 ranks 32 elements: rank 1's [32, 64) is all gap.
    dict(
        name='c4_gap_dp',
        sharding=DP,
        steps=2,
        sizes=[64, 1],
        dtype='bf16',
        bucket_size=None,
        check_content=True,
    ),
    # 4 with three buckets (buffer order [1, 64 | 256 | 1]): rank 1's part of the first bucket is
    # all gap, it holds a piece of the second, and its part of the third lies past the unpadded
    # end (saved as nothing, dropped by the load).
    dict(
        name='c4_gap_multi',
        sharding=DP,
        steps=2,
        sizes=[1, 256, 64, 1],
        dtype='bf16',
        bucket_size=65,
        check_content=True,
    ),
    dict(name='c4_gap_fr', sharding=FR, steps=2, sizes=[64, 1], dtype='bf16', bucket_size=None),
    dict(name='c6_uneven_dp_w4', sharding=DP, steps=2, **UNEVEN),
    # 4 at the unpadded end (buffer order [64, 1 | 1], 128 elements per bucket): rank 2 holds
    # exactly one element of the first bucket (the 1-element param) and only padding of the
    # second, rank 3 only padding of both (it saves nothing; the load puts both back).
    dict(
        name='c4_one_element',
        sharding=DP,
        steps=2,
        sizes=[1, 1, 64],
        dtype='bf16',
        bucket_size=65,
        check_content=True,
    ),
]

# The fork's arm of the shipped fixes: 0022 (distopt-mixed-dtype-group-state) and 0023
# (distopt-torch-adam-step).
C3_NAMES = ('c3_mixed_dp', 'c3_same_size_dp', 'c3_same_size_fr', 'c3_fp32_dp', 'c3_mixed_fr')
C5_NAMES = (
    'c5_adam_dp_fresh',
    'c5_adam_fr_fresh',
    'c5_adam_dp_stepped',
    'c5_adamw_dp_stepped',
    'c5_adam_fr_stepped',
    'c5_adamw_fr_stepped',
    'c5_adam_dp_never',
    'c5_adam_fr_never',
)
# 0042: an optimizer whose state and param groups carry no 'step' (as Lion), stepped when saved:
# its restored state stays (only a torch checkpoint with step 0 is "never stepped").
NOSTEP = dict(name='c5_nostep_dp_stepped', sharding=DP, adam='nostep', **TORCH)
ROUND_FORK = [case for case in ROUND_W2 if case['name'] in C3_NAMES + C5_NAMES] + [NOSTEP]
# 0027 (distopt-dp-reshardable-gap-shard).
C4_NAMES = ('c4_gap_dp', 'c4_gap_multi', 'c6_uneven_dp_w4', 'c4_one_element')
# 0027 with torch's Adam (0023: a per-param 0-d step; a rank that holds no param has no state).
C4_TORCH = [
    dict(ROUND_W4[0], name='c4_gap_dp_torch', adam='torch', load_steps=1),
    dict(ROUND_W4[1], name='c4_gap_multi_torch', adam='torch'),
]
ROUND_W4_FORK = [case for case in ROUND_W4 if case['name'] in C4_NAMES] + C4_TORCH

CALLS = {
    'fork-sched': call(2, FORK, SCHED, cases=SCHED_CASES, timeout=240),
    'fork-w2': call(2, FORK, ROUND, cases=ROUND_FORK, timeout=300),
    'fork-w4': call(4, FORK, ROUND, cases=ROUND_W4_FORK, timeout=240),
    'sched': call(2, PRISTINE, SCHED, cases=SCHED_CASES, timeout=240),
    'w2': call(2, PRISTINE, ROUND, cases=ROUND_W2, timeout=300),
    'w4': call(4, PRISTINE, ROUND, cases=ROUND_W4, timeout=240),
}


def _cases(key):
    """{case name: [per-rank result]} of one call; a rank or case error fails the test."""
    out = {}
    for rank, res in enumerate(CALLS[key].result()):
        assert 'error' not in res, f'{key} rank {rank}: {res["error"]}'
        for case in res['cases']:
            assert 'error' not in case, f'{key} rank {rank} {case["name"]}: {case["error"]}'
            out.setdefault(case['name'], []).append(case)
    return out


def _lrs(groups):
    return [g['lr'] for g in groups]


def _bounds(group):
    return tuple(group[k] for k in ('lr', 'max_lr', 'min_lr', 'weight_decay', 'start_wd', 'end_wd'))


def _bounds_by_name(groups, group_of):
    """{param name: its group's bounds} (``group_of``: the run's param name -> group index)."""
    return {name: _bounds(groups[index]) for name, index in group_of.items()}


def _resumed_bitwise(per_rank):
    """Saved and loaded without error, every local state tensor bitwise equal, and the next step
    of the resumed run equal to the next step of the run that never stopped."""
    for rank, res in enumerate(per_rank):
        where = (res['name'], rank)
        assert res['save_error'] is None and res['load_error'] is None, (where, res)
        assert 'mismatches' in res, (where, 'another rank failed', res)
        assert res['mismatches'] == [], (where, res['mismatches'])
        assert res['next_step_equal'], (where, res['next_step_max_diff'])
        assert res.get('content_wrong', []) == [], (where, res['content_wrong'])


# ------------------------------------------------------------------------------------------
# 1: --override-opt-param-scheduler with a new LR on resume.


def test_c1_override_new_lr():
    """Pristine keeps the checkpoint's group max_lr/min_lr: 0.18.2 runs the old schedule on (the
    LR of the run that never stopped), 0.19.2 cannot pair the groups any more (its identifier
    holds max_lr/min_lr since PR 4705) and raises KeyError; dev follows the new schedule."""
    for res in _cases('sched')['c1_override_new_lr']:
        assert res['save_error'] is None
        a, b_built, c = res['run_a'], res['run_b_built'], res['run_c']
        assert _lrs(a) != _lrs(c) and a[0]['max_lr'] != b_built[0]['max_lr']
        if FIXED['override-scheduler']:
            assert res['load_error'] is None
            assert _lrs(res['run_b']) == _lrs(c)
        elif BASE == '0.19.2':
            error = res['load_error']
            assert error.startswith('KeyError: ('), error
            assert f', {b_built[0]["max_lr"]}, {b_built[0]["min_lr"]},' in error, error
        else:
            assert res['load_error'] is None
            assert _lrs(res['run_b']) == _lrs(a)
            assert [g['max_lr'] for g in res['run_b']] == [g['max_lr'] for g in a]


# Per-module overrides changed on resume; with the flag unless the name says 'checkpoint'.
GROUPS_CHANGED = (
    'c1_override_new_group_lr',
    'c1_override_new_group_wd',
    'c1_override_dropped_group_wd',
    'c1_group_order_swaps_checkpoint',
    'c1_override_group_order_swaps',
    'c1_override_fewer_groups',
)


def test_c1_override_new_group_lr():
    """Per-module LR or WD overrides changed on resume (also two groups that swap places, and one
    override dropped): 0.19.2 cannot pair the changed groups (KeyError); 0.18.2 puts the last
    saved group's bounds on every group; dev pairs as 0.18.2, then in override mode restores each
    group's max_lr/min_lr and the start_wd/end_wd it has, so a group without its own keeps the
    saved group's start_wd/end_wd."""
    cases = _cases('sched')
    for name in GROUPS_CHANGED:
        for res in cases[name]:
            a, b, c = res['run_a'], res.get('run_b'), res['run_c']
            if BASE == '0.19.2':
                assert res['load_error'].startswith('KeyError: ('), (name, res['load_error'])
                continue
            assert res['load_error'] is None, (name, res['load_error'])
            if FIXED['override-scheduler'] and 'checkpoint' not in name:
                lr_bounds = [(g['lr'], g['max_lr'], g['min_lr']) for g in b]
                assert lr_bounds == [(g['lr'], g['max_lr'], g['min_lr']) for g in c], name
                for key in ('start_wd', 'end_wd'):
                    want = [a[-1][key] if g[key] is None else g[key] for g in c]
                    assert [g[key] for g in b] == want, (name, key)
            else:
                # The old bounds, and every group at the last saved group's (candidate 2 as well).
                assert [_bounds(g) for g in b] == [_bounds(a[-1])] * len(b), name
                assert [_bounds(g) for g in b] != [_bounds(g) for g in c], name


def test_c1_new_wd_checkpoint():
    """A new class weight decay, the checkpoint's schedule kept: upstream steps to the saved
    iteration before it reads the checkpoint's start_wd/end_wd, so right after the load the run
    has the new weight decay (run C's); dev (PR 5213) reads them first."""
    for res in _cases('sched')['c1_new_wd_checkpoint']:
        assert res['save_error'] is None and res['load_error'] is None, res
        a, b, c = res['run_a'], res['run_b'], res['run_c']
        assert _lrs(b) == _lrs(a) and a[0]['weight_decay'] != c[0]['weight_decay']
        if FIXED['override-scheduler']:
            assert [_bounds(g) for g in b] == [_bounds(g) for g in a]
        else:
            assert [g['weight_decay'] for g in b] == [g['weight_decay'] for g in c]


# ------------------------------------------------------------------------------------------
# 2: groups that differ only in max_lr/min_lr, min_lr, start_wd/end_wd or start_wd, resumed
# with the same args.


def test_c2_group_collision():
    """0.18.2 and dev pair the saved groups by (wd_mult, lr_mult, is_expert_parallel,
    is_decoupled_lr): the last saved group's LR/WD bounds land on every group. 0.19.2 resumes
    each group at the LR and WD of the run that never stopped."""
    cases = _cases('sched')
    names = ('c2_group_lr', 'c2_group_lr_fr', 'c2_group_wd', 'c2_group_min_lr', 'c2_group_start_wd')
    for name in names:
        for res in cases[name]:
            assert res['save_error'] is None and res['load_error'] is None, res
            a, b = res['run_a'], res['run_b']
            assert _bounds(a[0]) != _bounds(a[1])
            if FIXED['group-identifier']:
                assert [_bounds(g) for g in b] == [_bounds(g) for g in a], name
            else:
                assert [_bounds(g) for g in b] == [_bounds(a[-1])] * len(a), name


def test_c1_c2_fork_resumes_each_group():
    """With 0024 (PR 5213), 0025 (PR 4705) and 0026 (the old identifier as fallback) on every
    base: resumed with --override-opt-param-scheduler and new LRs, the optimizer loads and each
    group has the LR and bounds of run C (built with the new arguments, never stopped); resumed
    with the same arguments, each group keeps its own bounds, those of the run that never
    stopped; resumed with new per-group LRs but the checkpoint's schedule, each group keeps its
    own saved bounds (per param: the group order may change). Groups whose old identifier cannot
    tell which saved group was theirs (two changed overrides, fewer groups than saved) are
    refused. The counterfactual of the pristine tests of 1 and 2 above."""
    cases = _cases('fork-sched')
    assert sorted(cases) == sorted(case['name'] for case in SCHED_CASES)
    override = {case['name'] for case in SCHED_CASES if case.get('override_flag')}
    for name, per_rank in cases.items():
        for res in per_rank:
            assert res['save_error'] is None, (name, res)
            if name in SCHED_REFUSED:
                error = res['load_error'] or ''
                assert error.startswith('KeyError: ('), (name, error, res.get('run_b'))
                continue
            assert res['load_error'] is None, (name, res)
            run, group_of = ('run_c', 'group_of_b') if name in override else ('run_a', 'group_of_a')
            expected = res[run]
            assert len({_bounds(g) for g in expected}) == len(expected), (name, expected)
            assert [_bounds(g) for g in res['run_b']] == [_bounds(g) for g in expected], name
            assert _bounds_by_name(res['run_b'], res['group_of_b']) == _bounds_by_name(
                expected, res[group_of]
            ), name


# ------------------------------------------------------------------------------------------
# 3: one fp32 param among bf16 params in one param group.

VIEW_ERROR = (
    'RuntimeError: a view of a leaf Variable that requires grad is being used in an in-place'
    ' operation.'
)
FLAT_ERROR = 'CheckpointingException: ShardedTensor.flattened_range is not supported.'


def test_c3_group_order_map():
    """Before ceaa6c5d7e every local param of the mixed group maps to another param's main
    param (the order map follows the buffers, the group holds fp32 shards first)."""
    cases = _cases('w2')
    for name in ('c3_mixed_dp', 'c3_same_size_fr'):
        for res in cases[name]:
            [[wrong, total]] = res['map_wrong']
            assert total > 0 and wrong == (0 if FIXED['mixed-dtype'] else total), (name, res)


def test_c3_mixed_saves():
    cases = _cases('w2')
    if FIXED['mixed-dtype']:
        for name in ('c3_mixed_dp', 'c3_mixed_fr', 'c3_same_size_dp', 'c3_same_size_fr'):
            _resumed_bitwise(cases[name])
        return
    # Sizes differ: dp_reshardable asserts on the shape, fully_reshardable fails the copy.
    dp = [res['save_error'] for res in cases['c3_mixed_dp']]
    assert dp == [
        'AssertionError: (torch.Size([64]), 0, 90)',
        'AssertionError: (torch.Size([36]), 0, 86)',
    ]
    fr = [res['save_error'] for res in cases['c3_mixed_fr']]
    size = (
        'RuntimeError: The size of tensor a ({}) must match the size of tensor b ({}) at'
        ' non-singleton dimension 0'
    )
    assert fr == [size.format(90, 64), size.format(86, 36)]
    # Sizes agree: the fully_reshardable save succeeds with every param's state swapped; a resume
    # at the same layout swaps it back (bitwise), any other reader gets the wrong state.
    for res in cases['c3_same_size_fr']:
        assert res['save_error'] is None and res['load_error'] is None
        assert res['content_wrong'] == ['p.0', 'p.1', 'p.2']
        assert res['mismatches'] == [] and res['next_step_equal']


def test_c3_fp32_dp_reshardable_load():
    """dp_reshardable load into fp32 main params (autograd views of the model params)."""
    cases = _cases('w2')
    for name in ('c3_fp32_dp', 'c3_same_size_dp'):
        if FIXED['mixed-dtype']:
            _resumed_bitwise(cases[name])
        else:
            assert [res['load_error'] for res in cases[name]] == [VIEW_ERROR] * 2, name


def test_c3_fork_resumes_mixed_groups_bitwise():
    """With 0022 every mixed fp32/bf16 group maps each param to its own state, saves with
    dp_reshardable and fully_reshardable, writes each param's own state, and resumes bitwise
    (every state tensor and the next step) on every base: the counterfactual of the pristine
    failures above."""
    cases = _cases('fork-w2')
    assert sorted(cases) == sorted(C3_NAMES + C5_NAMES + (NOSTEP['name'],))
    for name in C3_NAMES:
        _resumed_bitwise(cases[name])
    for name in ('c3_mixed_dp', 'c3_same_size_fr'):
        for res in cases[name]:
            [[wrong, total]] = res['map_wrong']
            assert total > 0 and wrong == 0, (name, res['map_wrong'])


def test_c3_fs_model_space_unusable():
    """fully_sharded_model_space cannot be saved at all on any base (independent of 3)."""
    assert [res['save_error'] for res in _cases('w2')['c3_mixed_fs']] == [FLAT_ERROR] * 2


# ------------------------------------------------------------------------------------------
# 4: a rank whose dp_reshardable shard lies inside the 64-alignment gap between two params.


def test_c4_alignment_gap():
    cases = _cases('w4')
    per_rank = cases['c4_gap_dp']
    # One 128-element bucket without end padding; rank 1 holds no param.
    assert per_rank[0]['geometry'] == [[[128, 128]]]
    assert [res['local_params'] for res in per_rank] == [[[[1]]], [[[0]]], [[[1]]], [[[1]]]]
    errors = [res['save_error'] for res in per_rank]
    assert errors == [None, 'AssertionError: empty bucket encountered', None, None]
    assert all(res['files'] == [] for res in per_rank)  # the save never started
    _resumed_bitwise(cases['c4_gap_fr'])  # the same geometry, fully_reshardable
    multi = cases['c4_gap_multi']
    assert [res['local_params'] for res in multi][1] == [[[0, 1, 0]]]
    # Rank 1 fails on the gap bucket (pristine 0.18.2/0.19.2/dev lack 0015 too, so the ranks
    # whose part of the last bucket is only bucket-end padding fail the same way).
    assert multi[1]['save_error'] == errors[1]
    # A rank with exactly one unpadded element of a bucket fails the same way on its padding-only
    # part of the next bucket (as do the ranks whose part of it is only padding).
    one = cases['c4_one_element']
    assert one[0]['geometry'] == [[[128, 65], [128, 1]]]
    assert [res['local_params'] for res in one] == [[[[1, 1]]], [[[1, 0]]], [[[1, 0]]], [[[0, 0]]]]
    assert [res['save_error'] for res in one] == [None] + [errors[1]] * 3
    assert all(res['files'] == [] for res in one)


def test_c4_fork_saves_gap_shards():
    """With 0027 the rank whose part of a bucket lies in the gap between two params saves a
    padding entry for it: the save and the resume succeed, every state tensor and the next step
    equal the run that never stopped, and the checkpoint holds each param's own main param; also
    with a bucket past which the same rank holds only bucket-end padding, and for the geometry of
    6 (no gap shard); also a rank that holds exactly one unpadded element of a bucket and only
    padding of the next, and torch's Adam (a per-param step; no state on a rank without params).
    The counterfactual of test_c4_alignment_gap."""
    cases = _cases('fork-w4')
    torch_names = tuple(case['name'] for case in C4_TORCH)
    assert sorted(cases) == sorted(C4_NAMES + torch_names)
    for name in C4_NAMES + torch_names:
        _resumed_bitwise(cases[name])
    for name in ('c4_gap_dp', 'c4_gap_multi', 'c4_one_element') + torch_names:
        assert [res['content_wrong'] for res in cases[name]] == [[]] * 4, name
    one = cases['c4_one_element']
    assert one[0]['geometry'] == [[[128, 65], [128, 1]]]
    assert [res['local_params'] for res in one] == [[[[1, 1]]], [[[1, 0]]], [[[1, 0]]], [[[0, 0]]]]
    for case in C4_TORCH:
        for res in cases[case['name']]:
            n = len(res['step_b_next']['steps'])
            assert res['step_b_next']['steps'] == [case['steps'] + 1] * n, res['step_b_next']
    assert [len(res['step_b']['steps']) for res in cases['c4_gap_dp_torch']][1] == 0


# ------------------------------------------------------------------------------------------
# 5: torch's Adam/AdamW state through the distributed optimizer's save/load.


def test_c5_fused_layout_control():
    """The FusedAdam layout resumes bitwise from a fresh optimizer (the harness path works)."""
    cases = _cases('w2')
    for name in ('c5_fused_dp_fresh', 'c5_fused_fr_fresh'):
        _resumed_bitwise(cases[name])


def test_c5_torch_adam_fresh_load():
    """A restarted process (optimizer never stepped) cannot even build the load template:
    DistributedOptimizer.state_dict asserts one step over an empty per-param state."""
    cases = _cases('w2')
    for name in ('c5_adam_dp_fresh', 'c5_adam_fr_fresh'):
        for res in cases[name]:
            assert (res['load_stage'], res['load_error']) == (
                'sharded_state_dict',
                'AssertionError',
            )


def test_c5_torch_adam_never_stepped_save():
    """An optimizer that has not stepped cannot be saved (the same bare assertion)."""
    cases = _cases('w2')
    for name in ('c5_adam_dp_never', 'c5_adam_fr_never'):
        assert [res['save_error'] for res in cases[name]] == ['AssertionError'] * 2, name
        assert all(res['files'] == [] for res in cases[name]), name


def test_c5_torch_adam_dp_reshardable_step():
    """dp_reshardable restores the loading optimizer's own step count, and every local param
    then shares one step tensor that each step increments once per param."""
    cases = _cases('w2')
    for case in ROUND_W2:
        if case['name'] not in ('c5_adam_dp_stepped', 'c5_adamw_dp_stepped'):
            continue
        for res in cases[case['name']]:
            assert res['save_error'] is None and res['load_error'] is None
            assert {m['key'].rsplit('.', 1)[1] for m in res['mismatches']} == {'step'}
            assert {(m['saved'], m['loaded']) for m in res['mismatches']} == {
                (case['steps'], case['load_steps'])
            }
            assert not res['next_step_equal']
            n = len(res['step_b']['steps'])
            assert res['step_b']['shared_step_tensor'] == (n > 1)
            assert res['step_b_next']['steps'] == [case['load_steps'] + n] * n
            assert res['step_a_next']['steps'] == [case['steps'] + 1] * n


def test_c5_fork_resumes_torch_adam_bitwise():
    """With 0023, torch Adam and AdamW resume from dp_reshardable and fully_reshardable, into a
    fresh optimizer (a restart) and into one that has stepped: every state tensor, the step
    included, equals the saved one, the next step equals the run that never stopped, and each
    param's step then advances by one. With 0042 also from a checkpoint saved before the first
    step, after which the saving process itself trains on (its next step is its first). The
    counterfactual of the pristine tests of 5."""
    cases = _cases('fork-w2')
    for case in ROUND_W2:
        if case['name'] not in C5_NAMES:
            continue
        for res in cases[case['name']]:
            _resumed_bitwise([res])
            n = len(res['step_b_next']['steps'])
            assert n > 0 and res['step_b_next']['steps'] == [case['steps'] + 1] * n, res
            assert res['step_a_next']['steps'] == [case['steps'] + 1] * n, res['step_a_next']
            assert not res['step_b']['shared_step_tensor'], res['step_b']


def test_c5_fork_resumes_without_step_bitwise():
    """With 0042 an optimizer without a step count (as Lion; apex/TE layout) resumes bitwise
    from dp_reshardable: its groups carry no 'step', which is not a checkpoint saved before the
    first step, so the restored state stays."""
    for res in _cases('fork-w2')[NOSTEP['name']]:
        _resumed_bitwise([res])
        assert set(res['step_b']['steps']) == {None}, res['step_b']


def test_c5_torch_adam_fully_reshardable_load():
    cases = _cases('w2')
    for name in ('c5_adam_fr_stepped', 'c5_adamw_fr_stepped'):
        assert [res['load_error'] for res in cases[name]] == ["KeyError: 'step'"] * 2, name


# ------------------------------------------------------------------------------------------
# 6: dp_reshardable resume with uneven params (per-rank list lengths differ).


def test_c6_uneven_not_reproduced():
    """Rank 0 holds 1 param of the bucket, the last rank 4-6: the per-bucket lists never reach the
    common state (rank 0's read of it has no 'param_state'), and the resume is bitwise."""
    cases = {**_cases('w2'), **_cases('w4')}
    for name in ('c6_uneven_dp', 'c6_uneven_chained', 'c6_uneven_dp_w4'):
        per_rank = cases[name]
        counts = [res['local_params'][0][0][0] for res in per_rank]
        assert counts[0] == 1 and counts[-1] >= 4, (name, counts)
        assert per_rank[0]['common_param_state'] == []
        _resumed_bitwise(per_rank)
