"""Steps with different microbatch counts, overlap_grad_reduce without no_sync_func (patch 0013).

Every arm drives the real schedule (get_forward_backward_func: no pipelining, 1F1B, interleaved),
real DDP and the real optimizer (also the distributed optimizer) on CPU ranks, and compares with
the same steps under overlap_grad_reduce=False. Pristine dies with upstream's assertion when a
step has fewer microbatches than the first one and trains on wrong grads when it has more; the
fork's grads equal the reference, and the overlap (grad reduce dispatched during backward) is
kept on every step whose microbatch count equals the calibration step's.
"""

import pytest

from tests.harness import call
from tests.scenarios.variable_microbatches import random_sequences

S = 'tests.scenarios.variable_microbatches:'
FORK, PRISTINE = 'fork', 'pristine'
NO_COMM = 'AssertionError: Communication call has not been issued for this bucket'
IN_FLIGHT = 'RuntimeError: A forward/backward call with 2 microbatch(es) was started for a batch'

CASES = {
    'fewer': dict(steps=[4, 4, 2, 2]),
    'more': dict(steps=[4, 4, 6, 6]),
    'fewer_distopt': dict(steps=[4, 4, 2, 2], distopt=True, bucket_size=None),
    'more_distopt': dict(steps=[4, 4, 6, 6], distopt=True, bucket_size=None),
    'more_distopt_buckets': dict(steps=[4, 4, 6, 6], distopt=True),
    'no_sync': dict(steps=[4, 4, 2, 2, 6, 1], no_sync=True),
    'no_sync_later': dict(steps=[2, 2, 2, 2], no_sync=True, no_sync_from_step=2),
    'calls_same_total': dict(steps=[4, 4, [2, 2], [2, 2], 4]),
    'calls_finalize_each': dict(steps=[4, [2, 2], [2, 2]], finalize_each_call=True),
    'calls_shorter': dict(steps=[[2, 2], [2, 2], 2, [2, 2]]),
    'calls_longer': dict(steps=[4, 4, [4, 2]]),
    'calls_longer_distopt': dict(steps=[4, 4, [4, 2]], distopt=True, bucket_size=None),
}
PP = dict(sequences=[[4, 4, 2, 2], [4, 4, 6, 6]])
SEED, COUNT = 20261204, 10
# Part 'a': one forward_backward call per step; part 'b': some steps span several calls.
PARTS = {'a': dict(seed=SEED, count=COUNT), 'b': dict(seed=SEED + 1, count=COUNT, multi_call=True)}


def _calls(world, tree, cases):
    return {name: call(world, tree, S + 'scenario_sequence', **CASES[name]) for name in cases}


W2 = {tree: _calls(2, tree, CASES) for tree in (FORK, PRISTINE)}
PP4 = {
    (tree, vpp): call(4, tree, S + 'scenario_pipeline', vpp=vpp, **PP)
    for tree in (FORK, PRISTINE)
    for vpp in (1, 2)
}
PROP = {
    (world, part): call(world, FORK, S + 'scenario_property', timeout=300, **kw)
    for world in (2, 4)
    for part, kw in PARTS.items()
}


def _ranks(handle):
    per_rank = handle.result()
    for rank, res in enumerate(per_rank):
        assert 'overlap' in res or isinstance(res, list), f'rank {rank}: {res}'
    return per_rank


def _equal(res, steps=None):
    """Overlap run == overlap_grad_reduce=False run, step by step (bitwise grads and params)."""
    fork, ref = res['overlap'], res['reference']
    assert 'error' not in ref, ref['error']
    if steps is None:  # else: the steps before the one that failed
        assert 'error' not in fork, fork['error']
    n = len(ref['grads']) if steps is None else steps
    assert len(fork['grads']) == n
    assert fork['grads'] == ref['grads'][:n]
    assert fork['params'] == ref['params'][:n]
    if 'grad_norm' in ref:
        assert fork['grad_norm'] == ref['grad_norm'][:n]


def _pristine_dies_at(step, name):
    for res in _ranks(W2[PRISTINE][name]):
        assert res['overlap']['error'].startswith(NO_COMM) and res['overlap']['failed_step'] == step


def _fork_recalibrates_once(name):
    """The fork matches the reference; step 2 recalibrates, so only steps 1 and 3 overlap."""
    for res in _ranks(W2[FORK][name]):
        _equal(res)
        groups = res['overlap']['groups']
        assert res['overlap']['early'] == [0, groups, 0, groups]


def _expected_early(steps, groups):
    """Bucket groups that dispatch during backward, per step, by the fork's rule: a step keeps
    the calibration when its calls equal the calibration step's; a step whose calls are a strict
    prefix of them reduces in finish_grad_sync and keeps it; any other step recalibrates."""
    golden, early = None, []
    for step in steps:
        calls = tuple(step) if isinstance(step, list) else (step,)
        early.append(groups if calls == golden else 0)
        if not (golden and len(calls) < len(golden) and golden[: len(calls)] == calls):
            golden = calls
    return early


# --- counterfactual arms: no pipelining, world 2 -------------------------------------------


@pytest.mark.parametrize('name', ['fewer', 'fewer_distopt'])
def test_fewer_microbatches_pristine_dies_fork_trains(name):
    _pristine_dies_at(2, name)
    for res in _ranks(W2[PRISTINE][name]):
        _equal(res, steps=2)  # the steps before match
    _fork_recalibrates_once(name)


@pytest.mark.parametrize('name', ['more', 'more_distopt'])
def test_more_microbatches_pristine_wrong_grads_fork_trains(name):
    pristine = _ranks(W2[PRISTINE][name])
    for res in pristine:
        fork, ref = res['overlap'], res['reference']
        assert 'error' not in fork
        # Reduce dispatched after 4 of 6 microbatches: steps 2 and 3 reduce the wrong grads.
        assert fork['grads'][:2] == ref['grads'][:2]
        assert fork['grads'][2] != ref['grads'][2] and fork['grads'][3] != ref['grads'][3]
        assert max(fork['max_param_diff'][2:]) > 1e-4
    if not CASES[name].get('distopt'):  # ... and the replicas diverge: different grad norms
        assert pristine[0]['overlap']['grad_norm'][3] != pristine[1]['overlap']['grad_norm'][3]
    _fork_recalibrates_once(name)


def test_small_buckets_distopt_values_match():
    """Small buckets: the distributed optimizer's shards differ from the reference's (one
    bucket), so values compare, not bits."""
    for res in _ranks(W2[FORK]['more_distopt_buckets']):
        fork, ref = res['overlap'], res['reference']
        assert 'error' not in fork and len(fork['grads']) == 4
        assert max(fork['max_param_diff']) < 1e-6
        assert fork['early'] == [0, fork['groups'], 0, fork['groups']] and fork['groups'] == 4


def test_no_sync_func_keeps_overlap_on_every_count():
    """With no_sync_func the counts do not depend on the microbatch count: no recalibration."""
    for tree in (FORK, PRISTINE):
        for res in _ranks(W2[tree]['no_sync']):
            _equal(res)
            groups = res['overlap']['groups']
            assert res['overlap']['early'] == [0] + [groups] * 5


def test_no_sync_func_installed_after_two_steps():
    """Steps without no_sync_func, then with it (a warm-up before train()): pristine dies at the
    first step with it (0001's reset was the only way out); the fork recalibrates once."""
    _pristine_dies_at(2, 'no_sync_later')
    _fork_recalibrates_once('no_sync_later')


# --- one optimizer step over several forward_backward calls --------------------------------


def test_calls_with_the_same_total():
    for tree in (FORK, PRISTINE):
        for res in _ranks(W2[tree]['calls_same_total']):
            _equal(res)
    for res in _ranks(W2[FORK]['calls_same_total']):
        assert res['overlap']['early'] == _expected_early(
            CASES['calls_same_total']['steps'], res['overlap']['groups']
        )


def test_finalize_after_each_call():
    """finalize_model_grads after every call reduces the buffer each time, as without overlap;
    pristine dies at the first such step."""
    _pristine_dies_at(1, 'calls_finalize_each')
    for res in _ranks(W2[FORK]['calls_finalize_each']):
        _equal(res)
        assert res['overlap']['early'] == [0, 0, 0]


def test_step_with_fewer_calls_than_calibration():
    """A step whose calls are a strict prefix of the calibration step's reduces in
    finish_grad_sync and keeps the calibration (the next full step overlaps)."""
    _pristine_dies_at(2, 'calls_shorter')
    _fork_recalibrates_once('calls_shorter')


@pytest.mark.parametrize('name', ['calls_longer', 'calls_longer_distopt'])
def test_call_after_the_reduce_was_dispatched(name):
    """Step 2 adds a call after one that completed the calibrated step: pristine reduces
    without the second call's grads, silently; the fork raises naming cause and remedy."""
    for res in _ranks(W2[PRISTINE][name]):
        fork, ref = res['overlap'], res['reference']
        assert 'error' not in fork
        assert fork['grads'][:2] == ref['grads'][:2] and fork['grads'][2] != ref['grads'][2]
    for res in _ranks(W2[FORK][name]):
        fork = res['overlap']
        assert fork['error'].startswith(IN_FLIGHT), fork.get('error')
        assert 'reset_grad_ready_calibration()' in fork['error']
        assert fork['failed_step'] == 2
        _equal(res, steps=2)


# --- pipeline schedules, world 4 (PP 2, DP 2) ----------------------------------------------


@pytest.mark.parametrize('vpp', [1, 2])
def test_pipeline_schedules(vpp):
    for rank, per_seq in enumerate(_ranks(PP4[(PRISTINE, vpp)])):
        fewer, more = per_seq
        assert fewer['layout']['dp'] == 2 and fewer['layout']['pp'] == 2
        assert fewer['overlap']['error'].startswith(NO_COMM), (rank, fewer['overlap'])
        assert fewer['overlap']['failed_step'] == 2
        assert 'error' not in more['overlap']
        assert more['overlap']['grads'][2] != more['reference']['grads'][2]
    for per_seq in _ranks(PP4[(FORK, vpp)]):
        for res in per_seq:
            _equal(res)
            groups = res['overlap']['groups']
            assert res['overlap']['early'] == [0, groups, 0, groups]


# --- property: random microbatch-count sequences -------------------------------------------


def test_property_sequences_are_varied():
    seqs = [seq for kw in PARTS.values() for seq in random_sequences(**kw)]
    assert len(seqs) >= 20
    flat = [s for seq in seqs for s in seq]
    assert any(isinstance(s, list) for s in flat)
    assert sum(a == b for seq in seqs for a, b in zip(seq, seq[1:])) >= 10  # unchanged counts
    assert sum(a != b for seq in seqs for a, b in zip(seq, seq[1:])) >= 10  # changed counts


def _expected_error(steps):
    """The step at which the fork must raise: a step whose calls extend the calibration
    step's (its reduce is dispatched before the extra calls)."""
    golden = None
    for index, step in enumerate(steps):
        calls = tuple(step) if isinstance(step, list) else (step,)
        if golden and len(calls) > len(golden) and calls[: len(golden)] == golden:
            return index
        if not (golden and len(calls) < len(golden) and golden[: len(calls)] == calls):
            golden = calls
    return None


@pytest.mark.parametrize('world', [2, 4])
@pytest.mark.parametrize('part', ['a', 'b'])
def test_property_random_sequences(world, part):
    checked = 0
    for per_rank in zip(*_ranks(PROP[(world, part)])):
        for res in per_rank:
            steps, fork, ref = res['steps'], res['overlap'], res['reference']
            assert 'error' not in ref, (steps, ref['error'])
            failing = _expected_error(steps)
            if failing is None:
                assert 'error' not in fork, (steps, res['distopt'], fork['error'])
                n = len(steps)
            else:
                assert fork['error'].startswith('RuntimeError: A forward/backward call with')
                assert fork['failed_step'] == failing
                n = failing
            assert len(fork['grads']) == n
            if res['bucket_size'] is None:  # same layout as the reference: bitwise
                assert fork['grads'] == ref['grads'][:n], (steps, res['distopt'])
                assert fork['params'] == ref['params'][:n], (steps, res['distopt'])
            assert max(fork['max_param_diff'], default=0.0) < 1e-6, steps
            assert fork['early'] == _expected_early(steps, fork['groups'])[:n], steps
            if part == 'a':  # the overlap is kept whenever the count does not change
                for i in range(1, n):
                    assert (fork['early'][i] == fork['groups']) == (steps[i] == steps[i - 1])
            checked += 1
    assert checked == world * COUNT * 2 * 2


# --- two distributed-optimizer instances, world 4 (DP 4 = 2 instances x 2) -----------------
# With num_distributed_optimizer_instances > 1 the reduce runs synchronously on a communication
# stream (no handle) and finish_grad_sync skips upstream's "Communication call has not been
# issued" check: pristine's early or missing reduces train silently on wrong grads there.

INSTANCES = {
    'fewer_instances': dict(steps=[4, 4, 2, 2], distopt=True, bucket_size=None, instances=2),
    'calls_longer_instances': dict(
        steps=[4, 4, [4, 2]], distopt=True, bucket_size=None, instances=2
    ),
}
W4 = {
    (tree, name): call(4, tree, S + 'scenario_sequence', **kw)
    for tree in (FORK, PRISTINE)
    for name, kw in INSTANCES.items()
}


def test_two_instances_fewer_microbatches():
    """Step 2 has fewer microbatches: pristine never reduces it and raises nothing (wrong grads,
    wrong params); the fork recalibrates once and matches the reference bitwise."""
    for res in _ranks(W4[(PRISTINE, 'fewer_instances')]):
        fork, ref = res['overlap'], res['reference']
        assert 'error' not in fork and 'error' not in ref
        assert fork['grads'][:2] == ref['grads'][:2]
        assert fork['grads'][2] != ref['grads'][2] and fork['grads'][3] != ref['grads'][3]
        assert min(fork['max_param_diff'][2:]) > 1e-4
    for res in _ranks(W4[(FORK, 'fewer_instances')]):
        _equal(res)
        groups = res['overlap']['groups']
        assert res['overlap']['early'] == [0, groups, 0, groups]


def test_two_instances_call_after_the_reduce_was_dispatched():
    """Without a handle to look at, the fork still sees the reduce already dispatched (the
    counts reached the calibration's) and raises; pristine reduces without the second call."""
    for res in _ranks(W4[(PRISTINE, 'calls_longer_instances')]):
        fork, ref = res['overlap'], res['reference']
        assert 'error' not in fork
        assert fork['grads'][:2] == ref['grads'][:2] and fork['grads'][2] != ref['grads'][2]
    for res in _ranks(W4[(FORK, 'calls_longer_instances')]):
        fork = res['overlap']
        assert fork['error'].startswith(IN_FLIGHT)
        assert 'registers grads: [4]) matched the calibration batch ([4])' in fork['error']
        assert fork['failed_step'] == 2
        _equal(res, steps=2)


# --- reset_grad_ready_calibration() (0001) inside a step of several calls, fork only --------

RESETS = {
    # The documented use: before the step's first call. The step recalibrates, the next overlaps.
    'reset_before_first_call': dict(steps=[[2, 2]] * 4, reset_at=[[2, 0]]),
    # Between the two calls of step 2: the new calibration holds the second call only.
    'reset_between_calls': dict(steps=[[2, 2]] * 4, reset_at=[[2, 1]]),
}
W2_RESETS = {name: call(2, FORK, S + 'scenario_sequence', **kw) for name, kw in RESETS.items()}


def test_reset_before_the_first_call_of_a_multi_call_step():
    for res in _ranks(W2_RESETS['reset_before_first_call']):
        _equal(res)
        groups = res['overlap']['groups']
        assert res['overlap']['early'] == [0, groups, 0, groups]


def test_reset_between_two_calls_of_a_step():
    """The step of the reset trains right (its reduce waits for finish_grad_sync); it calibrates
    on the calls after the reset ([2], not [2, 2]), so the next [2, 2] step dispatches after its
    first call and its second call raises, naming that calibration, before touching a grad."""
    for res in _ranks(W2_RESETS['reset_between_calls']):
        fork = res['overlap']
        assert fork['failed_step'] == 3, fork.get('error')
        assert fork['error'].startswith(IN_FLIGHT)
        assert 'registers grads: [2]) matched the calibration batch ([2])' in fork['error']
        _equal(res, steps=3)
        groups = fork['groups']
        assert fork['early'] == [0, groups, 0]
