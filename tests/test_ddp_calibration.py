"""DDP grad-ready calibration: reset API (patch 0001) and over-count guard (patch 0002).

Every scenario runs the real megatron-core DDP wrapper on CPU ranks (gloo) or GPUs (nccl). Each arm
has a pristine counterfactual: pristine 0.18.2 lacks the API (AttributeError), dies after a naive
warm-up ("Communication call has not been issued ..."), and trains silently with wrong grads on an
over-count; the fork recalibrates, trains bit-identically to the reference, and raises on the
over-count.
"""

import pytest

from tests.harness.launcher import run_world

S = 'tests.scenarios.ddp_calibration:'
FORK = 'fork'
PRISTINE = 'pristine'

# name -> (scenario, kwargs)
FORK_CALLS = {
    'restore': ('scenario_reset_restores_calibration', {}),
    'restore_many': ('scenario_reset_restores_calibration', {'bucket_size': 1}),
    'drain': ('scenario_reset_drains_outstanding', {}),
    'drain_many': ('scenario_reset_drains_outstanding', {'bucket_size': 1}),
    'drain_ref': ('scenario_reset_drains_outstanding', {'reference': True}),
    'drain_many_ref': ('scenario_reset_drains_outstanding', {'reference': True, 'bucket_size': 1}),
    'over_ref': ('scenario_overcount', {'later_no_sync': True}),
    'over_bad': ('scenario_overcount', {}),
    'over_bad_mb4': ('scenario_overcount', {'microbatches': 4}),
    'warm_ref': ('scenario_naive_warmup', {'warmup_steps': 0, 'reset': False}),
    'warm_reset': ('scenario_naive_warmup', {'reset': True}),
    'warm_noreset': ('scenario_naive_warmup', {'reset': False}),
    'warm2_inflight_reset': (
        'scenario_naive_warmup',
        {'warmup_steps': 2, 'warmup_finish': False, 'reset': True},
    ),
    'warm2_inflight_noreset': (
        'scenario_naive_warmup',
        {'warmup_steps': 2, 'warmup_finish': False, 'reset': False},
    ),
    'legit': ('scenario_legit_registrations', {}),
    'gather_drain': ('scenario_reset_drains_param_gather', {}),
    'gather_drain_ref': ('scenario_reset_drains_param_gather', {'reference': True}),
    'gather_drain_many': ('scenario_reset_drains_param_gather', {'bucket_size': 1}),
    'gather_drain_many_ref': (
        'scenario_reset_drains_param_gather',
        {'reference': True, 'bucket_size': 1},
    ),
    'copyback': ('scenario_reset_drain_copies_back', {}),
    'copyback_ref': ('scenario_reset_drain_copies_back', {'reference': True}),
    'bound_g1': ('scenario_guard_boundary', {'golden': 1, 'registrations': 2}),
    'bound_g2': ('scenario_guard_boundary', {'golden': 2, 'registrations': 3}),
    'bound_g2_ok': ('scenario_guard_boundary', {'golden': 2, 'registrations': 2}),
}
PRISTINE_CALLS = {
    name: FORK_CALLS[name]
    for name in (
        'restore',
        'over_ref',
        'over_bad',
        'over_bad_mb4',
        'warm_reset',
        'warm_noreset',
        'warm2_inflight_noreset',
        'legit',
        'gather_drain',
        'copyback',
        'bound_g1',
        'bound_g2',
        'bound_g2_ok',
    )
}
PRISTINE_CALLS['warm2_inflight_step0'] = (
    'scenario_naive_warmup',
    {'warmup_steps': 2, 'warmup_finish': False, 'reset': False, 'steps': 1},
)

NO_COMM_CALL = 'AssertionError: Communication call has not been issued for this bucket'
NO_API = (
    "AttributeError: 'DistributedDataParallel' object has no attribute "
    "'reset_grad_ready_calibration'"
)
GUARD = 'RuntimeError: Grad-ready calibration mismatch'

_CACHE = {}


def _world(tree, world_size):
    key = (tree, world_size)
    if key not in _CACHE:
        calls = FORK_CALLS if tree == FORK else PRISTINE_CALLS
        names = list(calls)
        results = run_world(world_size, tree, [(S + calls[n][0], calls[n][1]) for n in names])
        _CACHE[key] = dict(zip(names, results))
    return _CACHE[key]


def _ok(per_rank):
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
    return per_rank


WS = [1, 2]


def _constructor_state(state):
    assert state == {
        'is_first_batch': True,
        'golden': [],
        'counts': [],
        'is_last_microbatch': True,
        'handle_outstanding': False,
        'param_gather_dispatched': False,
        'param_gather_outstanding': False,
        'grad_reduce_finished': False,
    }


@pytest.mark.parametrize('ws', WS)
@pytest.mark.parametrize('name,groups', [('restore', (1, 1)), ('restore_many', (4, 2))])
def test_reset_restores_calibration_on_fork(ws, name, groups):
    for res in _ok(_world(FORK, ws)[name]):
        assert (res['num_dense_groups'], res['num_expert_groups']) == groups
        n = sum(groups)
        assert res['result'] == [n, 0] and res['result_types'] == ['int', 'int']
        assert res['in_no_sync_result'] == [n, 0]
        assert res['last_mb_after_reset'] == [True] * n
        for before, after, again in zip(res['before'], res['after'], res['recalibrated']):
            assert not before['is_first_batch'] and before['golden'] and before['counts']
            _constructor_state(after)
            assert again['golden'] == before['golden'] and not again['is_first_batch']


@pytest.mark.parametrize('ws', WS)
def test_reset_keeps_golden_counts_when_asked(ws):
    for res in _ok(_world(FORK, ws)['restore_many']):
        assert res['kept_result'] == [0] * len(res['kept'])
        for recalibrated, kept, stepped in zip(
            res['recalibrated'], res['kept'], res['after_kept_step']
        ):
            assert kept['golden'] == recalibrated['golden'] and not kept['is_first_batch']
            assert kept['counts'] == [] and kept['is_last_microbatch']
            assert not kept['handle_outstanding'] and not kept['grad_reduce_finished']
            assert stepped['golden'] == recalibrated['golden'] and not stepped['is_first_batch']


@pytest.mark.parametrize('ws', WS)
def test_reset_options_pick_bucket_groups(ws):
    """recalibrate_params resets the kept groups holding one of them; keep_bucket_groups keeps
    those groups in a full reset."""
    for name in ('restore', 'restore_many'):
        for res in _ok(_world(FORK, ws)[name]):
            groups = len(res['kept'])
            assert res['recalibrate_params'] == [True] + [False] * (groups - 1)
            assert res['keep_bucket_groups'] == [True] * (groups - 1) + [False]


@pytest.mark.parametrize('ws', WS)
def test_pristine_has_no_reset_api(ws):
    world = _world(PRISTINE, ws)
    for name in ('restore', 'warm_reset', 'gather_drain', 'copyback'):
        for res in world[name]:
            assert res.get('error') == NO_API


@pytest.mark.parametrize('ws', WS)
@pytest.mark.parametrize('name', ['drain', 'drain_many'])
def test_reset_drains_outstanding_reduce(ws, name):
    world = _world(FORK, ws)
    ref = _ok(world[f'{name}_ref'])
    for rank, res in enumerate(_ok(world[name])):
        n = res['num_groups']
        assert res['result'] == [n, n]
        for before, after in zip(res['before'], res['after']):
            assert before['handle_outstanding'] and before['param_gather_dispatched']
            _constructor_state(after)
        # The step after the reset recalibrates and matches a run without the unfinished step.
        assert res['norms'] == ref[rank]['norms']
        assert all(g and set(g) == {1} for g in res['golden_after'])
    if name == 'drain_many':
        # Bucket layout (one group per param) does not change the reduced grads.
        assert ref[0]['norms'] == pytest.approx(_ok(world['drain_ref'])[0]['norms'], rel=1e-12)


@pytest.mark.parametrize('ws', WS)
@pytest.mark.parametrize('name', ['gather_drain', 'gather_drain_many'])
def test_reset_drains_outstanding_param_gather(ws, name):
    """Param all-gathers in flight (as after optimizer.step with overlap_param_gather) are
    completed by the reset; left in flight, the next forward's pre-hook would dispatch a second
    all-gather over the outstanding one ("assert self.param_gather_handle is None")."""
    world = _world(FORK, ws)
    ref = _ok(world[f'{name}_ref'])
    for rank, res in enumerate(_ok(world[name])):
        n = res['num_groups']
        assert n == (2 if name == 'gather_drain' else 6)
        assert res['result'] == [n, n]
        for before, after in zip(res['before'], res['after']):
            assert before['param_gather_outstanding'] and before['param_gather_dispatched']
            assert not before['handle_outstanding']
            _constructor_state(after)
        assert res['norms'] == ref[rank]['norms']
        assert all(g and set(g) == {1} for g in res['golden_after'])


@pytest.mark.parametrize('ws', WS)
def test_reset_drain_copies_back_fp32_main_grads(ws):
    """A reduce drained by the reset ends like finish_grad_sync: the reduced grads are copied
    from the bf16 buffer into the separate fp32 main_grads the optimizer reads."""
    world = _world(FORK, ws)
    ref = _ok(world['copyback_ref'])
    for rank, res in enumerate(_ok(world['copyback'])):
        assert res['extra_main_grads'] == res['num_params'] == 6
        assert res['main_grad_dtypes'] == ['torch.float32']
        assert res['result'] == [2, 2]
        assert res['main_grad_equals_buffer'] and ref[rank]['main_grad_equals_buffer']
        assert res['main_grads'] == ref[rank]['main_grads']
        # Steps 0 and 2 (the reference also finished step 1).
        assert res['norms'] == [ref[rank]['norms'][0], ref[rank]['norms'][2]]
        if ws == 2:  # the reduced grads differ from this rank's local accumulation
            assert res['main_grad_changed_by_reset']


@pytest.mark.parametrize('ws', WS)
def test_guard_boundary_without_reduce_in_flight(ws):
    """The count check alone, at its exact boundary: golden + 1 registrations raise while no
    reduce is in flight yet, golden registrations train. Pristine dispatches nothing and only
    fails at finish_grad_sync with the generic assertion."""
    fork, pristine = _world(FORK, ws), _world(PRISTINE, ws)
    for golden, name in ((1, 'bound_g1'), (2, 'bound_g2')):
        for res in fork[name]:
            assert res['norm'] is None
            assert res['raised'].startswith(GUARD)
            assert 'a param of shape (4, 16) registered' in res['raised']
            assert f'ready {golden + 1} time(s) in this batch' in res['raised']
            assert f'recorded {golden} (grad reduce in flight: False)' in res['raised']
        for res in pristine[name]:
            assert res['norm'] is None
            assert res['raised'] == f'{NO_COMM_CALL} (4/4 params have grad available)'
    for f, p in zip(_ok(fork['bound_g2_ok']), _ok(pristine['bound_g2_ok'])):
        assert f['golden'] == [[1, 1, 1, 2], [1, 1]]
        assert f['raised'] is None and p['raised'] is None
        assert f['norm'] == p['norm'] and f['calibration_norm'] == p['calibration_norm']


@pytest.mark.parametrize('ws', WS)
def test_naive_warmup_then_reset_trains(ws):
    fork, pristine = _world(FORK, ws), _world(PRISTINE, ws)
    ref = _ok(fork['warm_ref'])
    for res in pristine['warm_noreset']:
        assert res['error'] == f'{NO_COMM_CALL} (4/4 params have grad available)'
    for res in fork['warm_noreset']:  # patch 0007 adds which params fell short, and why
        assert res['error'].startswith(f'{NO_COMM_CALL} (4/4 params have grad available). ')
        assert 'registered fewer times than in the calibration batch' in res['error']
    for rank, res in enumerate(_ok(fork['warm_reset'])):
        assert [s['counts'] for s in res['state_after_warmup']] == [[2, 2, 2, 2], [2, 2]]
        assert res['reset'] == [2, 0]
        assert res['norms'] == ref[rank]['norms']
        assert res['golden'] == [[1, 1, 1, 1], [1, 1]]
    # Warm-up steps that never ran finish_grad_sync leave the reduce in flight: drained.
    for rank, res in enumerate(_ok(fork['warm2_inflight_reset'])):
        assert [s['golden'] for s in res['state_after_warmup']] == [[2, 2, 2, 2], [2, 2]]
        assert all(s['handle_outstanding'] for s in res['state_after_warmup'])
        assert res['reset'] == [2, 2]
        assert res['norms'] == ref[rank]['norms']
    # Without the reset: pristine waits on the stale handle at step 0 and asserts at step 1;
    # the guard stops the fork at step 0's first registration.
    for res in pristine['warm2_inflight_noreset']:
        assert res['error'] == f'{NO_COMM_CALL} (4/4 params have grad available)'
    # Pristine's step 0 waits on the stale (already completed) warm-up handle instead of reducing
    # its own grads, so it trains on each rank's unreduced local grads: exactly the local norm.
    # The scenario lets the stale reduce finish before step 0 starts, so this is not a race.
    step0 = _ok(pristine['warm2_inflight_step0'])
    for res in step0:
        assert res['norms'][0] == pytest.approx(res['local_norms'][0], rel=1e-6)
    if ws == 2:  # replicas disagree, both far from the reference
        assert step0[0]['local_norms'][0] != step0[1]['local_norms'][0]
        assert all(
            abs(r['norms'][0] - f['norms'][0]) / f['norms'][0] > 0.10 for r, f in zip(step0, ref)
        )
    for res in fork['warm2_inflight_noreset']:
        assert res['error'].startswith(GUARD)
        assert 'recorded 2 (grad reduce in flight: True)' in res['error']


@pytest.mark.parametrize('ws', WS)
def test_overcount_counterfactual(ws):
    fork, pristine = _world(FORK, ws), _world(PRISTINE, ws)
    ref = [r['norm'] for r in _ok(pristine['over_ref'])]
    assert ref == [r['norm'] for r in _ok(fork['over_ref'])]
    for name in ('over_bad', 'over_bad_mb4'):
        bad = [r['norm'] for r in _ok(pristine[name])]
        assert all(r['raised'] is None for r in pristine[name])
        if ws == 1 and name == 'over_bad':
            # Nothing to reduce across ranks: the early dispatch happens to be harmless at dp=1.
            assert bad == ref
        elif ws == 2:
            # Silent corruption: the replicas disagree, and at accumulation 2 both are >10% off.
            assert bad[0] != bad[1]
            if name == 'over_bad':
                assert all(abs(b - r) / r > 0.10 for b, r in zip(bad, ref))
        for res in fork[name]:
            assert res['norm'] is None
            assert res['raised'].startswith(GUARD)
            assert 'registered its grad as ready 2 time(s)' in res['raised']
            assert 'recorded 1 (grad reduce in flight: True)' in res['raised']
            assert 'without no_sync_func' in res['raised']
            assert 'reset_grad_ready_calibration()' in res['raised']
    # Against FP64 grads of the same batches computed in this run (every rank's microbatches):
    # the reference is the mean of the summed grads; pristine's early dispatch (settled before
    # microbatch 1) reduces microbatch 0 alone and adds this rank's microbatch 1 unreduced.
    for r, res in zip(ref, _ok(pristine['over_ref'])):
        assert r == pytest.approx(res['fp64']['reduced'], rel=1e-5)
    for res in pristine['over_bad']:
        assert res['norm'] == pytest.approx(res['fp64']['early'], rel=1e-5)
        if ws == 2:
            assert res['fp64']['early'] != pytest.approx(res['fp64']['reduced'], rel=0.1)


@pytest.mark.parametrize('ws', WS)
def test_guard_accepts_legitimate_registrations(ws):
    fork, pristine = _world(FORK, ws), _world(PRISTINE, ws)
    for f, p in zip(_ok(fork['legit']), _ok(pristine['legit'])):
        assert f['golden'] == [[1, 1, 1, 2], [1, 1]]
        assert f['norms'] == p['norms']
