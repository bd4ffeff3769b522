"""get_grad_norm_fp32 on a rank whose grads are all filtered out (patch 0017, upstream #5530).

The real optimizer filters the grads (shared params; TP duplicates on TP ranks > 0), then
``get_grad_norm_fp32`` reduces them for the inf, L1, L2 and L3 norms
(tests/scenarios/clip_grads_empty.py). Arms:
- fork: every norm type gives the FP64 norm of the logical grads, also on a rank with an empty
  list (0 where every rank's list is empty).
- pristine where the base lacks #5530 (dev, 0.18.2), counterfactual: the empty list raises
  ``ValueError: max() iterable argument is empty`` (inf) and a ``TypeError`` from all_reduce
  (L1, L3); L2 is right. The mixed case (one rank empty) is not run there: the other ranks
  would wait in the reduction until the process-group timeout.
- pristine 0.19.2 (upstream has the fix): same values as the fork.
"""

import pytest

from tests.harness import call
from tests.harness.bases import PRISTINE, upstream_has

MOD = 'tests.scenarios.clip_grads_empty:scenario_norms'
FIXED_UPSTREAM = upstream_has('grad-norm-empty-grads')
ALL_SHARED = {tree: call(1, tree, MOD, tp=1, shared=True) for tree in ('fork', PRISTINE)}
ALL_SHARED_W2 = call(2, 'fork', MOD, tp=2, shared=True)
MIXED = {
    tree: call(2, tree, MOD, tp=2, shared=False)
    for tree in ('fork',) + ((PRISTINE,) if FIXED_UPSTREAM else ())
}
INF_ERROR = 'ValueError: max() iterable argument is empty'
TYPE_ERROR = 'TypeError: Invalid function argument. Expected parameter `tensor` of type'


def _check(per_rank, sizes):
    assert [res.get('size') for res in per_rank] == sizes, per_rank
    for res in per_rank:
        for norm_type, value in res['norms'].items():
            assert value == pytest.approx(res['expected'][norm_type], rel=1e-6), (norm_type, res)


def test_fork_all_grads_filtered_out():
    _check(ALL_SHARED['fork'].result(), [0])
    _check(ALL_SHARED_W2.result(), [0, 0])


@pytest.mark.parametrize('tree', list(MIXED))
def test_rank_without_grads_joins_the_reduction(tree):
    """TP2, one non-TP param: TP rank 1 filters it out as a duplicate; both get rank 0's norm."""
    _check(MIXED[tree].result(), [1, 0])


def test_pristine():
    per_rank = ALL_SHARED[PRISTINE].result()
    if FIXED_UPSTREAM:
        _check(per_rank, [0])
        return
    [res] = per_rank
    assert res['size'] == 0
    assert res['norms']['inf'] == INF_ERROR
    assert res['norms']['1.0'].startswith(TYPE_ERROR)
    assert res['norms']['3.0'].startswith(TYPE_ERROR)
    assert res['norms']['2.0'] == 0.0
