"""Expert-aware gradient statistics (patches 0005 + 0006) on CPU ranks.

One launched world per (tree, world size); every scenario of that world runs in it. Arms:
- fork: exact oracle and every TP/EP/ETP layout match the FP64 reduction over logical params.
- pristine-0.19.2 (upstream fix, PR 5916): same values as the fork.
- pristine-0.18.2 (counterfactual): exact oracle reports sqrt(2) and 2 at any world size.
Item 6 (EP = 1, ETP != TP: expert grads synced as dense, patch 0009): fixed on the fork of every
base; pristine shows the dense sync wherever upstream lacks #5916's layer change.
"""

import importlib.util
import math

import pytest

from tests.harness import call
from tests.harness.bases import PRISTINE, upstream_has
from tests.scenarios.expert_grad_stats import layouts

MOD = 'tests.scenarios.expert_grad_stats'
SEEDS = [1, 2, 3]
REL = 1e-6


# Exact-oracle arms: name -> kwargs. bf16 is what the layouts use; fp16 and fp32 take other
# optimizer code paths (Float16Optimizer with a loss scaler; FP32Optimizer and the
# DistributedOptimizer's fp32 shard branch); pg_collection passes the process groups explicitly.
EXACT = {
    f'{dtype}_{"distopt" if distopt else "local"}{"_pgc" if pgc else ""}': dict(
        use_distributed_optimizer=distopt, dtype=dtype, pg_collection=pgc
    )
    for dtype in ('bf16', 'fp16', 'fp32')
    for distopt in (False, True)
    for pgc in (False, True)
    if not pgc or dtype == 'bf16'
}


# The emerging-optimizer entry of get_megatron_optimizer (optimizer='lion'), with 1x1 matrices:
# Lion takes 2-D params itself (1-D ones go to its Adam fallback through the standard call site),
# so the wrappers come from the emerging call site. Needs the emerging-optimizers package
# (tools/requirements-test.txt); without it these tests fail, naming the package.
HAVE_EMERGING = importlib.util.find_spec('emerging_optimizers') is not None
EMERGING = {
    'bf16_lion': dict(use_distributed_optimizer=False, dtype='bf16', optimizer='lion', matrix=True),
    'fp32_lion_pgc': dict(
        use_distributed_optimizer=False,
        dtype='fp32',
        optimizer='lion',
        pg_collection=True,
        matrix=True,
    ),
}
TORCH_DTYPE = {'bf16': 'torch.bfloat16', 'fp16': 'torch.float16', 'fp32': 'torch.float32'}
OPTIMIZER = {'bf16': 'Float16Optimizer', 'fp16': 'Float16Optimizer', 'fp32': 'FP32Optimizer'}


# Item 6: EP = 1 with ETP != TP, both ways round, on real expert layers in DDP.
ITEM6 = {'item6_tp2_etp1': dict(tp=2, ep=1, etp=1), 'item6_tp1_etp2': dict(tp=1, ep=1, etp=2)}


def _item6_calls(tree):
    return {
        name: call(2, tree, f'{MOD}:scenario_expert_layer_sync', **kw) for name, kw in ITEM6.items()
    }


def _register(tree, world_size, with_layouts):
    """Register this module's calls for (tree, world_size); they share the launch of that world.

    Returns:
        dict name -> call: the EXACT arms, then 'layouts' and 'item6' where they apply.
    """
    calls = {
        name: call(world_size, tree, f'{MOD}:scenario_exact_oracle', **kwargs)
        for name, kwargs in EXACT.items()
    }
    if HAVE_EMERGING and world_size == 2 and tree != 'pristine-0.19.2':
        for name, kwargs in EMERGING.items():
            calls[name] = call(world_size, tree, f'{MOD}:scenario_exact_oracle', **kwargs)
    if with_layouts:
        calls['layouts'] = call(world_size, tree, f'{MOD}:scenario_layouts', seeds=SEEDS)
    if world_size == 2 and tree in ('fork', PRISTINE):
        calls.update(_item6_calls(tree))
    if tree in ('fork', PRISTINE) and world_size in (2, 4):
        calls['sync_layouts'] = call(
            world_size,
            tree,
            f'{MOD}:scenario_expert_layer_sync_layouts',
            layout_list=layouts(world_size),
        )
    return calls


CALLS = {
    (tree, world): _register(tree, world, tree != 'pristine-0.19.2')
    for tree in ('fork', 'pristine-0.18.2', 'pristine-0.19.2')
    for world in (2, 4)
}
# World 1 (TP = EP = ETP = 1) is the only layout one GPU can run; there the oracle is sqrt(2), 2.
CALLS[('fork', 1)] = _register('fork', 1, True)
if (PRISTINE, 2) not in CALLS:  # dev: item 6 on the pristine dev tree
    CALLS[(PRISTINE, 2)] = _item6_calls(PRISTINE)
for _world_size in (2, 4):  # dev: the sync property on the pristine dev tree
    CALLS.setdefault((PRISTINE, _world_size), {}).setdefault(
        'sync_layouts',
        call(
            _world_size,
            PRISTINE,
            f'{MOD}:scenario_expert_layer_sync_layouts',
            layout_list=layouts(_world_size),
        ),
    )


def _world(tree, world_size):
    """Per-call name -> per-rank results for (tree, world_size), failing on any rank error."""
    results = {name: c.result() for name, c in CALLS[(tree, world_size)].items()}
    for name, per_rank in results.items():
        for rank, res in enumerate(per_rank):
            where = f'{tree} world {world_size} {name} rank {rank}'
            assert 'error' not in res, f'{where}: {res.get("error")}'
    return results


def _check_exact(per_rank, world, expect_fixed):
    norm = math.sqrt(1 + world) if expect_fixed else math.sqrt(2)
    zeros = 1 + world if expect_fixed else 2
    for res in per_rank:
        assert not res['found_inf']
        assert res['norm'] == pytest.approx(norm, rel=REL), res
        assert res['zeros'] == zeros, res


@pytest.mark.parametrize('world', [1, 2, 4])
@pytest.mark.parametrize('name', list(EXACT))
def test_fork_exact_oracle(world, name):
    per_rank = _world('fork', world)[name]
    _check_exact(per_rank, world, expect_fixed=True)
    dtype = name.split('_')[0]
    for res in per_rank:
        assert res['param_dtypes'] == [TORCH_DTYPE[dtype]]
        expected = 'DistributedOptimizer' if 'distopt' in name else OPTIMIZER[dtype]
        assert all(c.startswith(expected) for c in res['children']), res['children']
        # Both children carry both groups; the expert child's copies keep allreduce=False.
        assert all(res['children_tp_group_is_tp']) and all(res['children_expert_tp_group_is_etp'])
        assert False in res['expert_allreduce_seen']


@pytest.mark.parametrize('name', list(EMERGING))
def test_emerging_optimizer_path(name):
    if not HAVE_EMERGING:
        pytest.fail('emerging-optimizers is not installed: run tools/install.sh --test-deps')
    """The emerging-optimizer entry attaches both groups too; pristine 0.18.2 undercounts."""
    fork, pristine = _world('fork', 2)[name], _world('pristine-0.18.2', 2)[name]
    _check_exact(fork, 2, expect_fixed=True)
    _check_exact(pristine, 2, expect_fixed=False)
    for res in fork:
        expected = OPTIMIZER[name.split('_')[0]]
        assert len(res['children']) == 2 and all(c.startswith(expected) for c in res['children'])
        assert all(res['children_tp_group_is_tp']) and all(res['children_expert_tp_group_is_etp'])


@pytest.mark.parametrize('world', [1, 2, 4])
def test_fork_layouts_match_fp64_oracle(world):
    per_rank = _world('fork', world)['layouts']
    cases = per_rank[0]['cases']
    assert {tuple(c['layout']) for c in cases} == set(layouts(world))
    assert any(c['layout'][1] > 1 and c['layout'][2] > 1 for c in cases) or world < 4
    for other in per_rank[1:]:
        assert other['cases'] == cases, 'ranks report different statistics'
    bad = [
        c
        for c in cases
        if c['norm'] != pytest.approx(c['oracle_norm'], rel=REL) or c['zeros'] != c['oracle_zeros']
    ]
    assert not bad, bad


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_0_19_2_agrees(world):
    """Upstream's fix (0.19.2) gives the same values in every dtype / optimizer / pg arm."""
    results = _world('pristine-0.19.2', world)
    for name in EXACT:
        _check_exact(results[name], world, expect_fixed=True)


@pytest.mark.parametrize('world', [2, 4])
@pytest.mark.parametrize('name', list(EXACT))
def test_pristine_0_18_2_undercounts(world, name):
    """Counterfactual for every dtype / optimizer / pg_collection arm: sqrt(2) and 2."""
    _check_exact(_world('pristine-0.18.2', world)[name], world, expect_fixed=False)


def _check_item6(per_rank, fixed):
    for rank, res in enumerate(per_rank):
        grads, correct = res['grad_after_sync'], res['correct_grad_after_sync']
        if fixed:
            # Reduced over expert DP and scaled by 1/|dense DP|, as DDP does for expert buffers.
            assert set(res['allreduce'].values()) == {False}, res['allreduce']
            assert set(res['buffer'].values()) == {'expert'}, res['buffer']
            assert set(grads.values()) == {correct}, (rank, grads, correct)
            assert res['norm'] == pytest.approx(res['expected_norm'], rel=REL)
        else:
            # Synced as dense params over the dense DP group: the wrong replicas are summed.
            assert set(res['allreduce'].values()) == {True}, res['allreduce']
            assert set(res['buffer'].values()) == {'dense'}, res['buffer']
            assert correct not in set(grads.values()), (rank, grads, correct)
            assert res['norm'] != pytest.approx(res['expected_norm'], rel=REL)


@pytest.mark.parametrize('name', list(ITEM6))
def test_fork_item6_ep1_etp_ne_tp_expert_dp_synced(name):
    """EP = 1, ETP != TP (patch 0009, #5916's use_expert_pgs): expert grads over expert DP."""
    _check_item6(_world('fork', 2)[name], fixed=True)


@pytest.mark.parametrize('name', list(ITEM6))
def test_pristine_item6_ep1_etp_ne_tp(name):
    """Counterfactual: bases without #5916's layer change sync these expert params as dense."""
    _check_item6(_world(PRISTINE, 2)[name], fixed=upstream_has('expert-dp-sync-ep1'))


@pytest.mark.parametrize('world', [2, 4])
def test_expert_grad_sync_property_over_every_layout(world):
    """Real expert layers in DDP, every (TP, EP, ETP) within the world: the fork sums expert
    grads over expert DP and reports sqrt(logical elements) everywhere; pristine syncs them wrong
    exactly where EP = 1 and ETP != TP, unless the base has #5916's layer change (its norm may
    be wrong elsewhere too, where the grad-stats backports are missing)."""
    every = set(layouts(world))
    for rank, res in enumerate(_world('fork', world)['sync_layouts']):
        cases = res['cases']
        assert {tuple(c['layout']) for c in cases} == every
        assert [c for c in cases if not (c['grads_ok'] and c['norm_ok'])] == [], rank
        for c in cases:  # where the groups differ, expert params live in the expert buffers
            tp, ep, etp = c['layout']
            assert c['buffer'] == (['expert'] if ep > 1 or etp != tp else ['dense']), c
    expected = set()
    if not upstream_has('expert-dp-sync-ep1'):
        expected = {(tp, ep, etp) for tp, ep, etp in every if ep == 1 and etp != tp}
    for rank, res in enumerate(_world(PRISTINE, world)['sync_layouts']):
        cases = res['cases']
        assert {tuple(c['layout']) for c in cases} == every
        assert {tuple(c['layout']) for c in cases if not c['grads_ok']} == expected, rank


@pytest.mark.parametrize('world', [2, 4])
def test_pristine_0_18_2_layouts_disagree_with_fp64_oracle(world):
    """Counterfactual of the property test: pristine 0.18.2 is wrong exactly where experts are
    deduplicated over the wrong group, and right where there is nothing to deduplicate."""
    cases = _world('pristine-0.18.2', world)['layouts'][0]['cases']
    bad = {
        tuple(c['layout'])
        for c in cases
        if c['norm'] != pytest.approx(c['oracle_norm'], rel=REL) or c['zeros'] != c['oracle_zeros']
    }
    assert (2, 2, 1) in bad, bad  # TP2/EP2/ETP1: the second expert is dropped
    assert (1, 1, 1) not in bad  # no tensor or expert parallelism: nothing to get wrong
    assert all(tp > 1 or etp > 1 for tp, _, etp in bad), bad
