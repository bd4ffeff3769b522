"""Parameter norm right after a LayerWiseDistributedOptimizer step with overlapped gather (0020).

The real LayerWise optimizer (SGD base, bf16; dense and expert matrices; the legacy set-up and
the shard-aligned layout) on two DP ranks; ``calc_params_l2_norm`` is read right after
``optimizer.step()`` as ``--log-params-norm`` does (tests/scenarios/layer_wise_param_norm.py).
Arms:
- fork: the closed-form norm of the updated params on every rank, while the overlapped gather
  has not yet refreshed the params this rank does not own.
- pristine (counterfactual): owners' updated main params mixed with stale weights elsewhere: a
  different value on each rank, none of them the norm of the updated params.
- both: the right norm without overlap (the gather runs inside the step) and before any step.
"""

import pytest

from tests.harness import bases, call

S = 'tests.scenarios.layer_wise_param_norm:scenario_norm_after_step'
ARMS = {
    'legacy-overlap': dict(setup='legacy', overlap=True),
    'layout-overlap': dict(setup='layout', overlap=True),
    'legacy-no-overlap': dict(setup='legacy', overlap=False),
}
CALLS = {
    (tree, arm): call(2, tree, S, **kw)
    for tree in (bases.FORK, bases.PRISTINE)
    for arm, kw in ARMS.items()
}
FIXED_UPSTREAM = bases.upstream_has('layer-wise-param-norm-overlap')


def _results(tree, arm):
    per_rank = CALLS[(tree, arm)].result()
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
        assert res['before'] == pytest.approx(res['expected_before'], rel=1e-6)
    return per_rank


@pytest.mark.parametrize('arm', list(ARMS))
def test_fork_norm_is_that_of_the_updated_params(arm):
    per_rank = _results(bases.FORK, arm)
    for res in per_rank:
        assert res['after'] == pytest.approx(res['expected_after'], rel=1e-6)
    if 'no-overlap' not in arm:
        assert all(res['stale'] > 0 for res in per_rank), 'the gather was not deferred'


@pytest.mark.parametrize('arm', ['legacy-overlap', 'layout-overlap'])
def test_pristine_mixes_stale_weights(arm):
    per_rank = _results(bases.PRISTINE, arm)
    if FIXED_UPSTREAM:
        assert all(r['after'] == pytest.approx(r['expected_after'], rel=1e-6) for r in per_rank)
        return
    afters = [res['after'] for res in per_rank]
    assert afters[0] != pytest.approx(afters[1], rel=1e-3), afters
    for res in per_rank:
        assert res['stale'] > 0
        assert res['after'] > res['expected_after'] * (1 + 1e-3), res


def test_pristine_right_without_overlap():
    for res in _results(bases.PRISTINE, 'legacy-no-overlap'):
        assert res['after'] == pytest.approx(res['expected_after'], rel=1e-6)
        assert res['stale'] == 0
