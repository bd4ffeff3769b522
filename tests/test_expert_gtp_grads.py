"""Expert grads under generalized tensor parallelism (patch 0021, backport of upstream #6080).

EP = 1, ETP = TP and expert GTP != dense GTP: pristine 0.19.2 marks the local expert layers'
params ``allreduce=True``, and its GTP wrap drops the tag from expert weights altogether (also where
EP > 1 or ETP != TP set it False), so DDP reduces the expert weight shards over the dense DP group,
which holds expert-GTP peers with other rows. The fork reduces them over expert DP. Reference by
construction: the sum over the ranks holding the same shard (tests/scenarios/expert_gtp_grads.py).

Only bases with GTP run this (0.19.2; dev d48bd6be and 0.18.2 have none), read from
patches/changes.toml: the change is carried or upstream there.
"""

import pytest

from tests.harness import call, tiers
from tests.harness.bases import BASE, PRISTINE, carries, upstream_has
from tests.scenarios.expert_gtp_grads import layouts

CHANGE = 'expert-gtp-grad-sync'
HAS_GTP = carries(CHANGE) or upstream_has(CHANGE)
pytestmark = tiers.skipif(not HAS_GTP, 'no-gtp', f'base {BASE} has no generalized TP')

MOD = 'tests.scenarios.expert_gtp_grads'
# (TP, ETP, GTP, EGTP), EP = 1. Headline: EGTP 2 over GTP 1 (2 ranks: expert DP of one rank;
# 4 ranks: expert DP of two).
HEADLINE = (1, 1, 1, 2)
# Layout scans: every layout of 2 ranks; on 4 ranks every ETP = TP layout, plus ETP != TP with
# EGTP 2 (where pristine's old clause holds but the GTP wrap drops the tag).
LAYOUTS = {
    2: layouts(2),
    4: [lay for lay in layouts(4) if lay[0] == lay[1]] + [(1, 2, 1, 2), (2, 1, 2, 2), (2, 1, 1, 2)],
}
TREES = ('fork', PRISTINE)
DETAIL, SCAN = {}, {}
if HAS_GTP:
    for _world, _layouts in LAYOUTS.items():
        for _tree in TREES:
            _tp, _etp, _gtp, _egtp = HEADLINE
            DETAIL[_world, _tree] = call(
                _world,
                _tree,
                f'{MOD}:scenario_expert_gtp_sync',
                tp=_tp,
                etp=_etp,
                gtp=_gtp,
                egtp=_egtp,
            )
            SCAN[_world, _tree] = call(
                _world,
                _tree,
                f'{MOD}:scenario_expert_gtp_sync_layouts',
                timeout=120,
                layout_list=[list(lay) for lay in _layouts],
            )


def _result(c):
    per_rank = c.result()
    errors = [r['error'] for r in per_rank if 'error' in r]
    assert not errors, errors
    return per_rank


def _exact(res):
    return res['grad_after_sync'] == {n: [v] for n, v in res['correct_grad_after_sync'].items()}


@pytest.mark.parametrize('world', list(LAYOUTS))
def test_fork_reduces_expert_grads_over_expert_dp(world):
    """Every expert param is in the expert buffer and its grad is the sum over its replicas."""
    for rank, res in enumerate(_result(DETAIL[world, 'fork'])):
        assert (res['config_gtp'], res['config_egtp']) == (1, 2)
        assert res['gtp_sharded'] == {
            'fc1.bias': False,
            'fc1.weight': True,
            'fc2.bias': False,
            'fc2.weight': True,
        }
        assert set(res['allreduce'].values()) == {False}, res['allreduce']
        assert set(res['buffer'].values()) == {'expert'}, res['buffer']
        assert _exact(res), (rank, res['grad_after_sync'], res['correct_grad_after_sync'])
        # The weight replicas are exactly the expert-DP group; the dense DP group is larger.
        assert res['replicas']['fc1.weight'] == res['expert_dp_ranks'], rank
        assert len(res['dense_dp_ranks']) == world > len(res['expert_dp_ranks'])


@pytest.mark.parametrize('world', list(LAYOUTS))
def test_pristine_reduces_expert_weights_over_dense_dp(world):
    """Counterfactual: pristine puts the expert params in the dense buffer (the GTP weights lost
    their tag) and sums each weight shard over the dense DP group, i.e. with the other shards:
    2 ranks 3.0 where 1.0 / 2.0 are right, 4 ranks 15.0 where 5.0 / 10.0 are right."""
    if upstream_has(CHANGE):
        assert all(_exact(res) for res in _result(DETAIL[world, PRISTINE]))
        return
    for rank, res in enumerate(_result(DETAIL[world, PRISTINE])):
        assert res['allreduce'] == {
            'fc1.bias': True,
            'fc1.weight': None,
            'fc2.bias': True,
            'fc2.weight': None,
        }, res['allreduce']
        assert set(res['buffer'].values()) == {'dense'}, res['buffer']
        dense_sum = float(2**world - 1)  # the dense DP group is the whole world here
        shard_sum = float(sum(2**q for q in range(world) if q % 2 == rank % 2))
        for n in ('fc1.weight', 'fc2.weight'):
            assert res['grad_after_sync'][n] == [dense_sum], (rank, n, res['grad_after_sync'])
            assert res['correct_grad_after_sync'][n] == shard_sum
        # The biases are replicated over expert GTP too: the dense DP sum is theirs.
        for n in ('fc1.bias', 'fc2.bias'):
            assert res['grad_after_sync'][n] == [dense_sum], (rank, n)
            assert res['correct_grad_after_sync'][n] == dense_sum


@pytest.mark.parametrize('world', list(LAYOUTS))
def test_expert_gtp_sync_over_layouts(world):
    """Fork: every grad right in every layout, expert params in the expert buffers wherever an
    expert axis (ETP, expert GTP) differs from the dense one. Pristine: wrong exactly where the
    expert weights are GTP-sharded (EGTP > 1), which drops them into the dense buffer, and the
    dense DP group is not their expert DP group; right elsewhere."""
    expected_buffers = {
        tuple(lay): ['expert'] if (lay[0], lay[2]) != (lay[1], lay[3]) else ['dense']
        for lay in LAYOUTS[world]
    }
    for rank, res in enumerate(_result(SCAN[world, 'fork'])):
        cases = res['cases']
        assert [tuple(c['layout']) for c in cases] == [tuple(lay) for lay in LAYOUTS[world]]
        assert [c['layout'] for c in cases if not c['grads_ok']] == [], rank
        assert {tuple(c['layout']): c['buffer'] for c in cases} == expected_buffers, rank
    wrong = set()
    for rank, res in enumerate(_result(SCAN[world, PRISTINE])):
        cases = res['cases']
        bad = {tuple(c['layout']) for c in cases if not c['grads_ok']}
        expected = set()
        if not upstream_has(CHANGE):
            expected = {
                tuple(c['layout']) for c in cases if c['layout'][3] > 1 and c['groups_differ']
            }
        assert bad == expected, rank
        wrong |= bad
    if not upstream_has(CHANGE):
        assert HEADLINE in wrong  # EP = 1, ETP = TP, EGTP != GTP: the layout
        assert (world == 2) or {(1, 2, 1, 2), (2, 1, 2, 2)} <= wrong  # the dropped tag
