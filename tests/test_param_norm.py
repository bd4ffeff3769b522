"""Expert-aware parameter norm (patch 0010: ``calc_params_l2_norm``) on CPU ranks.

Arms, each through DDP, the real ``get_megatron_optimizer`` (bf16 and fp32, with and without the
distributed optimizer) and the real ``megatron.training.utils.calc_params_l2_norm``:
- fork: the exact oracle gives sqrt(1 + world); every TP/EP/ETP layout within 4 ranks matches the
  FP64 norm of the logical parameters, on every rank, from the optimizer's copies and from fresh
  fp32 copies.
- PRISTINE (counterfactual): the exact oracle gives sqrt(2) at any world size (the experts of dense
  TP ranks other than 0 are dropped), and the layouts where the dense and expert TP groups differ
  are wrong.
- pristine-0.19.2 (upstream fix, PR 5916): same values as the fork.
"""

import math

import pytest

from tests.harness import call
from tests.scenarios.expert_grad_stats import layouts
from tests.scenarios.param_norm import OPTIMIZER_KINDS

PRISTINE = 'pristine-0.18.2'
UPSTREAM_FIXED = 'pristine-0.19.2'
MOD = 'tests.scenarios.param_norm'
SEEDS = {1: [1, 2], 2: [1, 2], 4: [1]}
REL = 1e-6


def _register(tree, world_size, with_layouts):
    """Register this module's calls for (tree, world_size); they share the launch of that world."""
    calls = [
        call(
            world_size,
            tree,
            f'{MOD}:scenario_exact_oracle',
            dtype=dtype,
            use_distributed_optimizer=distopt,
        )
        for dtype, distopt in OPTIMIZER_KINDS
    ]
    if with_layouts:
        calls.append(
            call(
                world_size,
                tree,
                f'{MOD}:scenario_layouts',
                layout_list=layouts(world_size),
                seeds=SEEDS[world_size],
                timeout=240,
            )
        )
    return calls


CALLS = {('fork', world): _register('fork', world, True) for world in (1, 2, 4)}
CALLS.update({(PRISTINE, world): _register(PRISTINE, world, True) for world in (2, 4)})
CALLS[(UPSTREAM_FIXED, 2)] = _register(UPSTREAM_FIXED, 2, False)


def _world(tree, world_size):
    """Per-call, per-rank results for (tree, world_size), failing on any rank error."""
    results = [c.result() for c in CALLS[(tree, world_size)]]
    for per_rank in results:
        for rank, res in enumerate(per_rank):
            assert 'error' not in res, f'{tree} world {world_size} rank {rank}: {res["error"]}'
    return results


def _check_exact(results, expected):
    kinds = set()
    for per_rank in results[: len(OPTIMIZER_KINDS)]:
        for res in per_rank:
            kinds.add((res['dtype'], res['distopt']))
            assert res['norm'] == pytest.approx(expected, rel=REL), res
            assert res['norm_fp32_copy'] == pytest.approx(expected, rel=REL), res
    assert kinds == set(OPTIMIZER_KINDS)


def _wrong(case):
    oracle = pytest.approx(case['oracle_norm'], rel=REL)
    return case['norm'] != oracle or case['norm_fp32_copy'] != oracle


@pytest.mark.parametrize('world', [1, 2, 4])
def test_fork_exact_oracle(world):
    _check_exact(_world('fork', world), math.sqrt(1 + world))


@pytest.mark.parametrize('world', [1, 2, 4])
def test_fork_layouts_match_fp64_oracle(world):
    per_rank = _world('fork', world)[len(OPTIMIZER_KINDS)]
    cases = per_rank[0]['cases']
    assert {tuple(c['layout']) for c in cases} == set(layouts(world))
    assert {(c['dtype'], c['distopt']) for c in cases} == set(OPTIMIZER_KINDS)
    for other in per_rank[1:]:
        assert other['cases'] == cases, 'ranks report different parameter norms'
    bad = [c for c in cases if _wrong(c)]
    assert not bad, bad


def test_upstream_fixed_agrees():
    _check_exact(_world(UPSTREAM_FIXED, 2), math.sqrt(3))


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_drops_experts_of_other_tp_ranks(world):
    """Counterfactual: the expert scalar of dense TP ranks 1..W-1 is missing, on every path."""
    _check_exact(_world(PRISTINE, world), math.sqrt(2))


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_layouts_disagree_with_fp64_oracle(world):
    """Counterfactual of the property test: pristine is wrong where experts are deduplicated over
    the dense TP group instead of the expert one, and its ranks disagree with each other."""
    per_rank = _world(PRISTINE, world)[len(OPTIMIZER_KINDS)]
    cases = per_rank[0]['cases']
    bad = {(tuple(c['layout']), c['dtype'], c['distopt']) for c in cases if _wrong(c)}
    layouts_bad = {layout for layout, _, _ in bad}
    # TP2/EP2/ETP1: the expert of TP rank 1 is dropped; TP1/EP1/ETP2: ETP replicas counted twice.
    assert {(2, 2, 1), (1, 1, 2)} <= layouts_bad, bad
    assert {((2, 2, 1), dtype, distopt) for dtype, distopt in OPTIMIZER_KINDS} <= bad
    assert (1, 1, 1) not in layouts_bad  # no tensor or expert parallelism: nothing to get wrong
    assert all(tp != etp for tp, _, etp in layouts_bad), bad
    # TP2/EP1/ETP1: expert-DP is 2 but dense DP is 1, so the ranks report different norms.
    assert any(other['cases'] != cases for other in per_rank[1:])
