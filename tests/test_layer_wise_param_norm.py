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


# QK-clip right after a LayerWise step with overlapped gather (bf16, two DP ranks, a real
# two-layer TransformerBlock): on a rank that does not own a linear_qkv weight, pristine's
# weight has no main_param attribute and the fork's has main_param None (this patch); QK-clip
# must clip that rank's model weight on both trees, and the owner's main param, which the gather
# then hands to every rank.
QK = 'tests.scenarios.layer_wise_param_norm:scenario_qk_clip'
QK_SETUPS = ['layout', 'legacy']
QK_CALLS = {
    (tree, setup): call(2, tree, QK, setup=setup)
    for tree in (bases.FORK, bases.PRISTINE)
    for setup in QK_SETUPS
}


def _qk_results(tree, setup):
    per_rank = QK_CALLS[(tree, setup)].result()
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
    return per_rank


@pytest.mark.parametrize('setup', QK_SETUPS)
def test_qk_clip_after_overlapped_step(setup):
    fork, pristine = _qk_results(bases.FORK, setup), _qk_results(bases.PRISTINE, setup)
    for tree_results in (fork, pristine):
        # Each layer's weight is owned by one rank: both ranks take the non-owner path once.
        owners = [sum(res['owned'][layer] for res in tree_results) for layer in range(2)]
        assert owners == [1, 1], owners
        assert not all(tree_results[0]['owned']) and not all(tree_results[1]['owned'])
        for res in tree_results:
            assert res['max_logit'] == res['expected_max_logit']
            # After the gather every rank holds the owner's clipped weight: the FP64 reference
            # of step then clip, within bf16 rounding.
            for got, ref in zip(res['gathered'], res['reference']):
                assert got == pytest.approx(ref, rel=2**-7, abs=2**-9)
            assert res['gathered'] == tree_results[0]['gathered']
    # The fork's guard keeps pristine's behaviour bit for bit, on owners and non-owners.
    for f, p in zip(fork, pristine):
        assert f['owned'] == p['owned']
        assert f['after_clip'] == p['after_clip']
        assert f['gathered'] == p['gathered']
