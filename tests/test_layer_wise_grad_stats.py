"""Gradient statistics of LayerWiseDistributedOptimizer (patch 0011) on CPU ranks.

Arms, each through DDP (plain, and with the LayerWise shard-aligned layout), the real
``_get_param_groups`` / ``_get_megatron_optimizer_based_on_param_groups`` and the real
``LayerWiseDistributedOptimizer`` (bf16; LayerWise wraps its children itself):
- fork: exact oracle sqrt(1 + 2 EP) / 1 + 2 EP, including dense DP 1 with expert DP > 1; every
  TP/EP/ETP layout within 4 ranks matches the FP64 reduction over the logical gradients; one real
  step leaves every rank with the right parameters (layout set-up).
- PRISTINE (counterfactual): experts deduplicated over dense TP (too small with ETP < TP, too large
  with ETP > TP) and, when dense DP is 1 but expert DP is not, expert replicas counted once per
  expert-DP rank.
- pristine-0.19.2: has the same bug (upstream fixed only the group half, PR 6099, on main).
"""

import math

import pytest

from tests.harness import call
from tests.scenarios.expert_grad_stats import layouts

PRISTINE = 'pristine-0.18.2'
ALSO_BUGGY = 'pristine-0.19.2'
MOD = 'tests.scenarios.layer_wise_grad_stats'
SETUPS = ('legacy', 'layout')
REL = 1e-6
# (tp, ep, etp) of the exact oracle per world size, and what pristine reports there.
# TP2/EP2/ETP1: the expert bias of TP rank 1 is dropped (dense-TP deduplication): 2.0 vs sqrt(5).
# TP2/EP1/ETP1: dense DP 1, expert DP 2; LayerWise does not shard, so the expert weight counts on
# both expert-DP replicas while the expert bias of TP rank 1 is dropped: 2.0 vs sqrt(3).
EXACT = {
    2: {(2, 2, 1): (2.0, 4), (2, 1, 1): (2.0, 4)},
    # TP4/EP1/ETP1: dense DP 1, expert DP 4: the expert weight counts 4 times: sqrt(6) vs sqrt(3).
    4: {(4, 4, 1): (math.sqrt(6), 6), (4, 1, 1): (math.sqrt(6), 6), (2, 2, 1): (2.0, 4)},
}


def _register(tree, world_size, with_layouts):
    """Register this module's calls for (tree, world_size); they share the launch of that world."""
    calls = {
        ('exact', layout, setup): call(
            world_size,
            tree,
            f'{MOD}:scenario_exact_oracle',
            tp=layout[0],
            ep=layout[1],
            etp=layout[2],
            setup=setup,
        )
        for layout in EXACT.get(world_size, {})
        for setup in SETUPS
    }
    if with_layouts:
        calls['layouts'] = call(
            world_size,
            tree,
            f'{MOD}:scenario_layouts',
            layout_list=layouts(world_size),
            seeds=[1, 2],
            timeout=240,
        )
    if with_layouts and world_size == 2:
        # One world size only: the layout set-up's step is slow on CPU ranks at world 4.
        calls['step'] = call(
            world_size,
            tree,
            f'{MOD}:scenario_step',
            layout_list=layouts(world_size),
            seed=3,
            setups=['layout'],
            timeout=240,
        )
    return calls


CALLS = {('fork', world): _register('fork', world, True) for world in (1, 2, 4)}
CALLS.update({(PRISTINE, world): _register(PRISTINE, world, True) for world in (2, 4)})
CALLS[(ALSO_BUGGY, 2)] = _register(ALSO_BUGGY, 2, False)


def _result(tree, world_size, key):
    per_rank = CALLS[(tree, world_size)][key].result()
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'{tree} world {world_size} rank {rank}: {res["error"]}'
    return per_rank


def _wrong(case):
    return (
        case['norm'] != pytest.approx(case['oracle_norm'], rel=REL)
        or case['zeros'] != case['oracle_zeros']
    )


@pytest.mark.parametrize('world', [2, 4])
def test_fork_exact_oracle(world):
    for layout in EXACT[world]:
        for setup in SETUPS:
            for res in _result('fork', world, ('exact', layout, setup)):
                assert not res['found_inf']
                assert res['norm'] == pytest.approx(res['expected_norm'], rel=REL), res
                assert res['zeros'] == res['expected_zeros'], res
                assert res['expected_norm'] == pytest.approx(math.sqrt(1 + 2 * layout[1]))


def _check_pristine_exact(tree, world):
    for layout, (norm, zeros) in EXACT[world].items():
        for setup in SETUPS:
            for res in _result(tree, world, ('exact', layout, setup)):
                assert res['norm'] == pytest.approx(norm, rel=REL), (layout, setup, res)
                assert res['zeros'] == zeros, (layout, setup, res)
                assert norm != pytest.approx(res['expected_norm'], rel=REL)


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_exact_oracle_is_wrong(world):
    _check_pristine_exact(PRISTINE, world)


def test_pristine_0_19_2_has_the_same_bug():
    _check_pristine_exact(ALSO_BUGGY, 2)


@pytest.mark.parametrize('world', [1, 2, 4])
def test_fork_layouts_match_fp64_oracle(world):
    per_rank = _result('fork', world, 'layouts')
    cases = per_rank[0]['cases']
    assert {tuple(c['layout']) for c in cases} == set(layouts(world))
    assert {c['setup'] for c in cases} == set(SETUPS)
    for other in per_rank[1:]:
        assert other['cases'] == cases, 'ranks report different statistics'
    bad = [c for c in cases if _wrong(c)]
    assert not bad, bad


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_layouts_disagree_with_fp64_oracle(world):
    cases = _result(PRISTINE, world, 'layouts')[0]['cases']
    bad = {(tuple(c['layout']), c['setup']) for c in cases if _wrong(c)}
    for setup in SETUPS:
        assert ((2, 2, 1), setup) in bad, bad  # dense-TP deduplication of experts
        assert ((1, 1, 2), setup) in bad, bad  # ETP replicas counted once per ETP rank
        assert ((1, 1, 1), setup) not in bad  # nothing to get wrong
    # Dense DP 1, expert DP 2: expert replicas counted twice.
    assert ((2, 1, 1), 'legacy') in bad, bad


@pytest.mark.parametrize('world', [2])
@pytest.mark.parametrize('tree', ['fork', PRISTINE])
def test_step_updates_every_param_once(tree, world):
    """The fork now shards experts over expert DP when dense DP is 1; the step must stay right."""
    per_rank = _result(tree, world, 'step')
    for rank, res in enumerate(per_rank):
        assert {tuple(c['layout']) for c in res['cases']} == set(layouts(world))
        wrong = [c for c in res['cases'] if c['wrong_elements']]
        assert not wrong, (rank, wrong)
