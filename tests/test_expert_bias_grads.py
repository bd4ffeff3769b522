"""Expert fc2 bias grads are reduced over their expert-DP replicas only (patch 0016, issue 22/9).

Upstream's MoELayer (local spec: SequentialMLP of RowParallelLinear/ColumnParallelLinear experts,
biases on, sequence parallel whenever TP > 1) in DDP, one real forward/backward, then the real
``finalize_model_grads`` (tests/scenarios/expert_bias_grads.py). Arms:
- fork: every param after finalize_model_grads equals the sum of the unreduced grads over its
  replicas (expert DP for expert params, the whole world for the router and a dense
  RowParallelLinear bias beside the MoE layer) / dense DP, in every layout; the per-param
  totals agree with TP1/EP=world, where no grad is reduced at all.
- pristine (counterfactual, every base): the expert fc2 bias is also summed over the dense TP
  group: TP2/EP2/ETP1 gives rank 0's expert 0 the bias grad of rank 1's expert 2 added
  (the two grads summed where one is right); with every grad set to rank + 1, 3.0 where 1.0 / 2.0
  are right, and at TP2/EP1/ETP1 6.0 where 3.0 is right on bases that reduce expert params over
  expert DP (0.19.2 upstream, the fork's 0009 elsewhere).
Upstream refuses MoE biases with ETP > 1, and with biases the local experts cannot train at
EP = ETP = 1 on any pristine base (an in-place add on the output of a size-1 reduce, mlp.py;
the fork's 0033 moe-expert-bias-out-of-place trains them, and this test checks their grads
there); on pristine those layouts are covered by the 'fill' mode (grads written, then
finalize_model_grads).
"""

import pytest

from tests.harness import call
from tests.harness.bases import PRISTINE, carries, upstream_has

MOD = 'tests.scenarios.expert_bias_grads:scenario_bias_grads'
TREES = ('fork', PRISTINE)
TRAIN_LAYOUTS = {
    2: [[2, 2, 1], [1, 2, 1], [2, 1, 1]],
    4: [[2, 2, 1], [2, 4, 1], [4, 2, 1], [4, 4, 1], [1, 4, 1], [1, 2, 1]],
}
FILL_LAYOUTS = {
    2: [[2, 2, 1], [2, 1, 1], [1, 2, 1], [1, 1, 1], [2, 1, 2]],
    4: [[2, 2, 1], [2, 1, 1], [4, 1, 1], [4, 2, 1], [1, 1, 1], [2, 1, 2]],
}
CALLS = {
    (tree, world, mode): call(
        world,
        tree,
        MOD,
        layout_list=(TRAIN_LAYOUTS if mode == 'train' else FILL_LAYOUTS)[world],
        mode=mode,
    )
    for tree in TREES
    for world in (2, 4)
    for mode in ('train', 'fill')
}
REFUSED = 'AssertionError: Bias in Moe is only supported when ETP==1'
INPLACE = 'is a view and is being modified inplace'
# The fork trains MoE biases at EP = ETP = 1 (0033); pristine fails them with INPLACE.
EP1_TRAINS = carries('moe-expert-bias-out-of-place')
FC2_BIAS = 'linear_fc2.bias'


def _ok(p, exact=False):
    return p['max_err'] == 0 if exact else p['max_err'] <= 1e-5 * max(1.0, p['scale'])


def _results(tree, world, mode):
    per_rank = CALLS[(tree, world, mode)].result()
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'{tree} world {world} {mode} rank {rank}: {res["error"]}'
    return per_rank


def _cases(per_rank, layout):
    return [next(c for c in res['cases'] if c['layout'] == layout) for res in per_rank]


def _wrong(per_rank, exact=False):
    """{(layout, rank, param)} whose grad after finalize_model_grads is not the correct one."""
    return {
        (tuple(c['layout']), rank, name)
        for rank, res in enumerate(per_rank)
        for c in res['cases']
        if 'error' not in c
        for name, p in c['params'].items()
        if not _ok(p, exact)
    }


@pytest.mark.parametrize('world', [2, 4])
@pytest.mark.parametrize('mode', ['train', 'fill'])
def test_fork_every_param_reduced_over_its_replicas(world, mode):
    per_rank = _results('fork', world, mode)
    assert not _wrong(per_rank, exact=mode == 'fill')
    ran = {tuple(c['layout']) for c in per_rank[0]['cases'] if 'error' not in c}
    layouts = TRAIN_LAYOUTS if mode == 'train' else FILL_LAYOUTS
    trains = {tuple(l) for l in layouts[world] if l[1] > 1 or mode == 'fill' or EP1_TRAINS}
    assert ran == trains - {(2, 1, 2)}
    for res in per_rank:  # the marks behind it: no expert param is summed over dense TP
        for c in res['cases']:
            for name, p in c.get('params', {}).items():
                if name.startswith('expert'):
                    assert p['allreduce'] is False or c['layout'][0] == 1, (c['layout'], name)
                    assert not p['sequence_parallel'], (c['layout'], name)
                elif name != 'dense.weight':
                    assert p['sequence_parallel'] is (c['layout'][0] > 1), (c['layout'], name)


@pytest.mark.parametrize('world', [2, 4])
def test_fork_totals_match_the_layout_without_any_reduction(world):
    """Per param, the unreduced grads summed over the ranks that hold it are the same in every
    layout as at TP1/EP=world (each token processed once), so the expectations are the model's."""
    per_rank = _results('fork', world, 'train')
    ref = _cases(per_rank, [1, world, 1])[0]['total']
    for c in per_rank[0]['cases']:
        if 'error' in c:
            continue
        assert set(c['total']) == set(ref)
        for name, values in c['total'].items():
            assert values == pytest.approx(ref[name], rel=1e-5, abs=1e-6), (c['layout'], name)


@pytest.mark.parametrize('tree', TREES)
def test_upstream_refuses_or_fails_the_same_on_every_tree(tree):
    """ETP > 1 with MoE biases is refused on every tree; training the local experts with biases
    at EP = 1 fails upstream, and trains on the fork (0033)."""
    for world in (2, 4):
        for res in _results(tree, world, 'fill'):
            assert _cases([res], [2, 1, 2])[0]['error'] == REFUSED
        for res in _results(tree, world, 'train') if world == 2 else ():
            case = _cases([res], [2, 1, 1])[0]
            if tree == 'fork' and EP1_TRAINS:
                assert 'error' not in case, case['error']
            else:
                assert INPLACE in case['error']


def test_pristine_tp2_ep2_adds_the_other_rank_s_expert():
    """Counterfactual with real grads: rank 0's expert 0 gets rank 1's expert 2 (its dense TP
    peer's first local expert) added."""
    rank0, rank1 = _cases(_results(PRISTINE, 2, 'train'), [2, 2, 1])
    got = rank0['params'][f'expert0.{FC2_BIAS}']
    other = rank1['params'][f'expert2.{FC2_BIAS}']['want']
    # Both expectations come from this run's own reference grads (no value measured once).
    assert abs(other) > 1e-3 * max(abs(got['want']), 1.0)  # the added grad is not negligible
    assert got['got'] == pytest.approx(got['want'] + other, rel=1e-5, abs=1e-6)
    assert got['got'] != pytest.approx(got['want'], rel=1e-3)
    fork0, _ = _cases(_results('fork', 2, 'train'), [2, 2, 1])
    fork_got = fork0['params'][f'expert0.{FC2_BIAS}']
    assert fork_got['want'] == got['want']  # the same reference on both trees
    assert fork_got['got'] == pytest.approx(got['want'], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_wrong_exactly_in_the_expert_fc2_bias_where_tp_exceeds_one(world):
    """Train mode (EP > 1): only the expert fc2 bias is wrong, in every layout with TP > 1."""
    per_rank = _results(PRISTINE, world, 'train')
    wrong = _wrong(per_rank)
    assert wrong and all(name.endswith(FC2_BIAS) for _, _, name in wrong), wrong
    expected = {tuple(l) for l in TRAIN_LAYOUTS[world] if l[0] > 1 and l[1] > 1}
    assert {layout for layout, _, _ in wrong} == expected


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_fill_numbers(world):
    """Every grad = rank + 1. With TP > 1 the expert fc2 bias is its correct value summed over
    the dense TP group (other experts with EP > 1; with EP = 1 the expert-DP replicas that DDP
    already summed, where the base puts expert params in the expert buffers). Where it puts them
    in the dense buffers (EP = 1 without #5916) the TP sum happens to complete the bias."""
    per_rank = _results(PRISTINE, world, 'fill')
    for layout in FILL_LAYOUTS[world]:
        cases = _cases(per_rank, layout)
        if 'error' in cases[0] or layout[0] == 1:
            continue
        want = [
            next(p['want'] for n, p in c['params'].items() if n.endswith(FC2_BIAS) and 'xpert' in n)
            for c in cases
        ]
        for rank, c in enumerate(cases):
            tp_sum = sum(want[t] for t in c['groups']['tp_ranks'])
            dense_buffers = layout[1] == 1 and not upstream_has('expert-dp-sync-ep1')
            for name, p in c['params'].items():
                if name.startswith('expert') and name.endswith(FC2_BIAS):
                    assert p['want'] == want[rank]
                    assert p['got'] == (p['want'] if dense_buffers else tp_sum), (layout, rank, p)
                    assert dense_buffers or p['got'] != p['want'], (layout, rank, p)
    if world == 2:
        rank0, rank1 = _cases(per_rank, [2, 2, 1])
        assert rank0['params'][f'expert0.{FC2_BIAS}']['got'] == 3.0  # correct: 1.0
        assert rank1['params'][f'expert2.{FC2_BIAS}']['got'] == 3.0  # correct: 2.0
        tp2ep1 = _cases(per_rank, [2, 1, 1])[0]['params'][f'expert0.{FC2_BIAS}']
        assert tp2ep1['want'] == 3.0
        assert tp2ep1['got'] == (6.0 if upstream_has('expert-dp-sync-ep1') else 3.0)
