"""GatedDeltaNet's ``out_norm`` weight under TP 2 without sequence parallelism (issue 39 item 4).

tests/scenarios/gdn_out_norm.py runs the tree's GatedDeltaNet through DDP, finalize_model_grads
and Adam at TP 2 (with and without SP) and at TP 1 (the reference, one rank, on the fork's tree:
at TP 1 the change does nothing), with the same logical parameters and input.

- Fork: without SP every TP rank's ``out_norm`` grad equals the TP 1 layer's, the grad norm is
  the reference's and the weight copies stay equal over five steps; with SP the same (summed
  once, not twice).
- Pristine (counterfactual): without SP the ranks' grads differ and only their sum is the
  reference's (each is its heads' partial), the grad norm misses, the copies drift apart; with SP
  it is right (the control).
"""

import pytest
import torch

from tests.harness import bases, call

S = 'tests.scenarios.gdn_out_norm:scenario_gdn_out_norm'
TP2 = [dict(name='tp2-nosp', tp=2), dict(name='tp2-sp', tp=2, sp=True)]
RUNS = {
    (tree, world): call(world, tree, S, cases=cases, timeout=300)
    for tree, world, cases in (
        (bases.FORK, 1, [dict(name='tp1', tp=1)]),  # the reference of both arms (at TP 1 the
        (bases.FORK, 2, TP2),  # change does nothing: finalize_model_grads returns first)
        (bases.PRISTINE, 2, TP2),
    )
}


def _rows(tree, world, name):
    rows = []
    for rank, res in enumerate(RUNS[(tree, world)].result()):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
        [row] = [c for c in res['cases'] if c['name'] == name]
        assert 'error' not in row, f'rank {rank}: {row["error"]}'
        rows.append(row)
    return rows


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def _close(a, b):
    return torch.allclose(_t(a), _t(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('name', ['tp2-nosp', 'tp2-sp'])
def test_fork_out_norm_grads_are_the_tp1_layers(name):
    [ref] = _rows(bases.FORK, 1, 'tp1')
    ranks = _rows(bases.FORK, 2, name)
    for row in ranks:
        assert _close(row['out_norm_grad'], ref['out_norm_grad']), (row['out_norm_grad'], ref)
        assert row['grad_norm'] == pytest.approx(ref['grad_norm'], rel=1e-6)
    assert _t(ranks[0]['out_norm_weight_after']).equal(_t(ranks[1]['out_norm_weight_after']))


def test_pristine_out_norm_grads_are_partials_without_sp():
    [ref] = _rows(bases.FORK, 1, 'tp1')
    r0, r1 = _rows(bases.PRISTINE, 2, 'tp2-nosp')
    assert not _close(r0['out_norm_grad'], ref['out_norm_grad'])
    assert _close(
        (_t(r0['out_norm_grad']) + _t(r1['out_norm_grad'])).tolist(), ref['out_norm_grad']
    )
    assert r0['grad_norm'] != pytest.approx(ref['grad_norm'], rel=1e-6)
    assert not _t(r0['out_norm_weight_after']).equal(_t(r1['out_norm_weight_after']))


def test_pristine_out_norm_grads_with_sp_control():
    [ref] = _rows(bases.FORK, 1, 'tp1')
    for row in _rows(bases.PRISTINE, 2, 'tp2-sp'):
        assert _close(row['out_norm_grad'], ref['out_norm_grad'])
