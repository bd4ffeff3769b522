"""Learnable attention-sink offset under TP: grad norm, zero count, param norm, clipping (0008).

``DotProductAttention(softmax_type='learnable')`` shards ``softmax_offset`` by heads over TP. Arms:
- fork: closed forms (sqrt(HEADS + DENSE), HEADS + DENSE), the FP64 norm of the logical grads of a
  real backward, a clipped SGD step of exactly ``clip_grad``, and every TP/EP/ETP layout of 2 and 4
  ranks against the FP64 oracle, in fp32 and bf16, with and without the distributed optimizer.
- pristine 0.18.2 and 0.19.2 (counterfactual; the code is the same there): the offset counts on TP
  rank 0 only, so norm sqrt(HEADS / TP + DENSE), HEADS / TP + DENSE zeros, and a clipped update
  larger than ``clip_grad``; layouts with TP = 1 stay right.
"""

import math

import pytest

from tests.harness import call
from tests.scenarios.attention_sink_grad_stats import DENSE, HEADS, layouts

MOD = 'tests.scenarios.attention_sink_grad_stats'
FORK = 'fork'
PRISTINE = 'pristine-0.18.2'
PRISTINE_0_19 = 'pristine-0.19.2'
TREES = (FORK, PRISTINE, PRISTINE_0_19)
VARIANTS = [(dtype, distopt) for dtype in ('fp32', 'bf16') for distopt in (False, True)]
SEEDS = [1, 2]
REL = 1e-6


def _register(tree, world):
    calls = {}
    for dtype, distopt in VARIANTS:
        kwargs = dict(tp=world, dtype=dtype, distopt=distopt)
        calls[('exact', dtype, distopt)] = call(world, tree, f'{MOD}:scenario_exact', **kwargs)
        calls[('clip', dtype, distopt)] = call(
            world, tree, f'{MOD}:scenario_backward_clip', **kwargs
        )
    if tree != PRISTINE_0_19:
        # Pristine 0.18.2 also gets expert statistics wrong (fixed by 0006): no expert there.
        calls['layouts'] = call(
            world,
            tree,
            f'{MOD}:scenario_layouts',
            layout_list=layouts(world),
            seeds=SEEDS,
            with_expert=tree == FORK,
        )
    return calls


CALLS = {(tree, world): _register(tree, world) for tree in TREES for world in (2, 4)}


def _expected(tp, fixed):
    heads = HEADS if fixed else HEADS // tp
    return math.sqrt(heads + DENSE), heads + DENSE


def _ok(per_rank):
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
    return per_rank


@pytest.mark.parametrize('world', [2, 4])
@pytest.mark.parametrize('tree', TREES)
def test_exact_closed_form(tree, world):
    fixed = tree == FORK
    norm, zeros = _expected(world, fixed)
    for variant in VARIANTS:
        for res in _ok(CALLS[(tree, world)][('exact', *variant)].result()):
            assert res['local_heads'] == HEADS // world
            assert not res['found_inf']
            assert res['norm'] == pytest.approx(norm, rel=REL), (variant, res)
            assert res['zeros'] == zeros, (variant, res)
            assert res['param_norm'] == pytest.approx(norm, rel=REL), (variant, res)
            if fixed:
                attrs = (res['tensor_model_parallel'], res['partition_dim'])
                assert attrs + (res['partition_stride'],) == (True, 0, 1)
            else:
                assert res['tensor_model_parallel'] is None


@pytest.mark.parametrize('world', [2, 4])
@pytest.mark.parametrize('tree', TREES)
def test_backward_norm_and_clipping(tree, world):
    fixed = tree == FORK
    for dtype, distopt in VARIANTS:
        per_rank = _ok(CALLS[(tree, world)][('clip', dtype, distopt)].result())
        for res in per_rank:
            assert res['ok']
            # The layer's grads are right on every tree: against a plain-torch FP64 reference.
            tol = 1e-5 if dtype == 'fp32' else 5e-3
            assert res['offset_grad'] == pytest.approx(res['reference_offset_grad'], abs=tol)
            assert res['norm'] == per_rank[0]['norm']
            if fixed:
                assert res['norm'] == pytest.approx(res['oracle_norm'], rel=REL), res
                if res['update_norm'] is not None:  # clipped SGD step: exactly clip_grad
                    assert res['update_norm'] == pytest.approx(res['clip_grad'], rel=1e-4), res
            else:
                # TP ranks > 0 drop their heads: norm too small, clipping weaker than configured.
                assert res['norm'] < 0.95 * res['oracle_norm'], res
                if res['update_norm'] is not None:
                    assert res['update_norm'] > 1.05 * res['clip_grad'], res
        if not distopt:
            assert per_rank[0]['update_norm'] is not None


@pytest.mark.parametrize('world', [2, 4])
def test_fork_layouts_match_fp64_oracle(world):
    per_rank = _ok(CALLS[(FORK, world)]['layouts'].result())
    cases = per_rank[0]['cases']
    assert {tuple(c['layout']) for c in cases} == set(layouts(world))
    assert len(cases) == len(layouts(world)) * 2 * len(SEEDS)
    for other in per_rank[1:]:
        assert other['cases'] == cases, 'ranks report different statistics'
    bad = [
        c
        for c in cases
        if c['norm'] != pytest.approx(c['oracle_norm'], rel=REL)
        or c['param_norm'] != pytest.approx(c['oracle_param_norm'], rel=REL)
        or c['zeros'] != c['oracle_zeros']
    ]
    assert not bad, bad


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_layouts_wrong_exactly_where_tp_splits_heads(world):
    """Pristine reports exactly the statistics of a model whose sink has TP rank 0's heads only."""
    cases = _ok(CALLS[(PRISTINE, world)]['layouts'].result())[0]['cases']
    assert len(cases) == len(layouts(world)) * 2 * len(SEEDS)
    for case in cases:
        key = 'oracle' if case['layout'][0] == 1 else 'tp0_only'
        assert case['norm'] == pytest.approx(case[f'{key}_norm'], rel=REL), case
        assert case['param_norm'] == pytest.approx(case[f'{key}_param_norm'], rel=REL), case
        assert case['zeros'] == case[f'{key}_zeros'], case
    assert any(c['layout'][0] > 1 and c['norm'] < 0.99 * c['oracle_norm'] for c in cases)


# The layer as upstream builds it by default (perform_initialization=True: config.init_method
# draws the offsets), TP 2: one real backward whose last head (on TP rank 1) gets a zero grad.
INIT_VARIANTS = [('fp32', False), ('bf16', True)]
INIT = {
    (tree, dtype, distopt): call(
        2, tree, f'{MOD}:scenario_initialized', tp=2, dtype=dtype, distopt=distopt
    )
    for tree in TREES
    for dtype, distopt in INIT_VARIANTS
}


@pytest.mark.parametrize('tree', TREES)
def test_initialized_offsets_statistics(tree):
    fixed = tree == FORK
    key = 'oracle' if fixed else 'tp0_only'
    for dtype, distopt in INIT_VARIANTS:
        per_rank = _ok(INIT[(tree, dtype, distopt)].result())
        for res in per_rank:
            assert res['ok']
            assert res['tensor_model_parallel'] is (True if fixed else None)
            # The init drew values (not the empty tensor's), and both ranks see the same logical
            # offsets, the concatenation of the TP shards in TP-rank order.
            assert res['init_offset'] == per_rank[0]['init_offset']
            assert res['init_offset'] == per_rank[0]['local_offset'] + per_rank[1]['local_offset']
            assert len(set(res['init_offset'])) > 1
            # The layer's grads are right on every tree: against a plain-torch FP64 reference.
            tol = 1e-5 if dtype == 'fp32' else 5e-3
            assert res['offset_grad'] == pytest.approx(res['reference_offset_grad'], abs=tol)
            assert res['offset_grad'][-1] == 0.0 and res['oracle_zeros'] == 1
            # Fork: every TP rank's sinks counted; pristine: TP rank 0's only.
            assert res['norm'] == pytest.approx(res[f'{key}_norm'], rel=REL), res
            assert res['zeros'] == res[f'{key}_zeros'], res
            assert res['param_norm'] == pytest.approx(res[f'{key}_param_norm'], rel=REL), res
            if not fixed:
                assert res['zeros'] == 0 and res['norm'] < res['oracle_norm'], res
                assert res['param_norm'] < res['oracle_param_norm'], res


def test_initialized_offsets_same_on_fork_and_pristine():
    """The fix marks the parameter only: the drawn offsets and their grads are the same bits on
    both trees. Every TP rank draws its shard from the default generator, seeded alike on all
    ranks (not from the TP-rank RNG tracker the linear layers use), so the shards are equal."""
    for dtype, distopt in INIT_VARIANTS:
        fork = _ok(INIT[(FORK, dtype, distopt)].result())
        for tree in (PRISTINE, PRISTINE_0_19):
            for f, p in zip(fork, _ok(INIT[(tree, dtype, distopt)].result())):
                assert f['init_offset'] == p['init_offset']
                assert f['offset_grad'] == p['offset_grad']
        assert fork[0]['local_offset'] == fork[1]['local_offset']
