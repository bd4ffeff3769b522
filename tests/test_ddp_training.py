"""DDP + distributed optimizer on CPU ranks against a single-rank float64 reference."""

import math

import pytest

from tests.harness import call

TRAIN = 'tests.scenarios.ddp_training:scenario_train'
LAYOUT = 'tests.scenarios.ddp_training:scenario_layout'
TREES = ['fork', 'pristine']
FP32_TOL = 1e-5

BASE = {}
for _tree in TREES:
    for _world in (1, 2, 4):
        BASE[_world, _tree] = call(_world, _tree, TRAIN, steps=3, num_microbatches=2)

# Variants at world 2 (fp32 unless named): (id, kwargs)
VARIANTS = [
    ('no-overlap', dict(overlap=False)),
    ('no-distopt', dict(distopt=False)),
    ('no-overlap-no-distopt', dict(overlap=False, distopt=False)),
    ('accum-1', dict(num_microbatches=1)),
    ('accum-3', dict(num_microbatches=3)),
    ('no-expert', dict(expert=False)),
    ('one-bucket', dict(bucket_size=None)),
    ('sgd', dict(optimizer='sgd', lr=0.05, distopt=False)),  # distopt is Adam-only upstream
    ('avg-in-collective', dict(ddp_kwargs={'average_in_collective': True})),
]
VARIANT_CALLS = {
    (name, tree): call(2, tree, TRAIN, steps=3, **kwargs)
    for name, kwargs in VARIANTS
    for tree in TREES
}
LOW_PRECISION = {
    (name, tree): call(2, tree, TRAIN, steps=3, **kwargs)
    for name, kwargs in [
        ('bf16', dict(dtype='bf16')),
        ('bf16-fp32-reduce', dict(dtype='bf16', ddp_kwargs={'grad_reduce_in_fp32': True})),
        ('bf16-no-distopt', dict(dtype='bf16', distopt=False)),
        ('fp16', dict(dtype='fp16')),
    ]
    for tree in TREES
}
TP2 = {tree: call(4, tree, TRAIN, steps=2, parallel={'tp': 2}) for tree in TREES}

LAYOUTS = [
    dict(tp=2),
    dict(tp=4),
    dict(pp=2),
    dict(ep=2),
    dict(ep=4),
    dict(tp=2, ep=2, etp=1),
    dict(tp=2, ep=1, etp=2),
    dict(tp=1, ep=2, etp=2),
    dict(cp=2, ep=2),
]
LAYOUT_CALLS = {
    (i, tree): call(4, tree, LAYOUT, **layout) for i, layout in enumerate(LAYOUTS) for tree in TREES
}


def _no_errors(per_rank):
    errors = [r['error'] for r in per_rank if 'error' in r]
    assert not errors, errors


def _check_fp32(per_rank):
    _no_errors(per_rank)
    for r in per_rank:
        assert all(r['ok'])
        assert r['max_loss_diff'] < FP32_TOL, (r['losses'], r['ref_losses'])
        assert r['max_grad_norm_diff'] < FP32_TOL, (r['grad_norms'], r['ref_grad_norms'])
        assert r['max_param_diff'] < FP32_TOL
    assert len({r['param_digest'] for r in per_rank}) == 1, 'ranks disagree on params'


@pytest.mark.parametrize('tree', TREES)
@pytest.mark.parametrize('world', [1, 2, 4])
def test_distopt_overlap_matches_float64_reference(world, tree):
    per_rank = BASE[world, tree].result()
    _check_fp32(per_rank)
    r = per_rank[0]
    assert r['dp_size'] == world
    assert r['n_bucket_groups'] >= 2, 'bucket_size should give several bucket groups'
    assert r['n_expert_bucket_groups'] >= 1
    assert r['optimizer'] == 'ChainedOptimizer'


@pytest.mark.parametrize('tree', TREES)
@pytest.mark.parametrize('name', [v[0] for v in VARIANTS])
def test_variants_match_float64_reference(name, tree):
    per_rank = VARIANT_CALLS[name, tree].result()
    _check_fp32(per_rank)
    if name == 'no-expert':
        assert per_rank[0]['n_expert_bucket_groups'] == 0
    if name == 'one-bucket':
        assert per_rank[0]['n_bucket_groups'] == 1


@pytest.mark.parametrize('tree', TREES)
def test_tp2_dp2_matches_float64_reference(tree):
    per_rank = TP2[tree].result()
    _check_fp32(per_rank)
    assert per_rank[0]['dp_size'] == 2


@pytest.mark.parametrize('tree', TREES)
@pytest.mark.parametrize('name', ['bf16', 'bf16-fp32-reduce', 'bf16-no-distopt', 'fp16'])
def test_low_precision_trains(name, tree):
    per_rank = LOW_PRECISION[name, tree].result()
    _no_errors(per_rank)
    for r in per_rank:
        assert all(math.isfinite(x) for x in r['losses'] + r['grad_norms'])
        assert all(r['ok'])
        # bf16/fp16 params: compare with the float64 run at half-precision tolerance.
        assert r['max_loss_diff'] < 5e-3, (r['losses'], r['ref_losses'])
        assert r['max_param_diff'] < 1e-2
    assert len({r['param_digest'] for r in per_rank}) == 1


@pytest.mark.parametrize('tree', TREES)
@pytest.mark.parametrize('index', range(len(LAYOUTS)), ids=[str(layout) for layout in LAYOUTS])
def test_parallel_state_layouts(index, tree):
    layout = LAYOUTS[index]
    per_rank = LAYOUT_CALLS[index, tree].result()
    _no_errors(per_rank)
    tp, pp, cp = layout.get('tp', 1), layout.get('pp', 1), layout.get('cp', 1)
    ep = layout.get('ep', 1)
    etp = layout.get('etp') or tp
    for r in per_rank:
        assert (r['tp'], r['pp'], r['cp'], r['ep'], r['etp']) == (tp, pp, cp, ep, etp)
        assert r['dp'] == 4 // (tp * pp * cp)
        assert r['dp_cp'] == 4 // (tp * pp)
        assert r['edp'] == 4 // (ep * etp * pp)
    if pp == 1 and cp == 1:
        pairs = sorted((r['tp_rank'], r['dp_rank']) for r in per_rank)
        assert pairs == sorted((t, d) for t in range(tp) for d in range(4 // tp))
