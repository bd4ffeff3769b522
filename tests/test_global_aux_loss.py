"""The global load-balancing loss's router gradient at DP > 1 (issue 39 item 3).

Upstream's ``global_aux_loss`` (Megatron-LM issues 7213 and 3672, PRs 7214 and 5007, open):

(a) the per-expert counts are summed over the step's microbatches so far, averaged over their
    number and divided by the current microbatch's token count, so f is off by the ratio of the
    mean count so far to the current one whenever microbatches hold different numbers of valid
    tokens (padding, packing);
(b) each DP rank's loss is its share of the global loss (its own tokens' probs over the global
    token count), and DDP averages the shares instead of summing them: 1/DP of the loss's
    gradient under the mean loss; under per-token loss the rank's share is rescaled by a count
    that is not the global loss's own.

tests/scenarios/global_aux_loss.py runs the tree's router through the real schedule, DDP and
finalize_model_grads on DP 2 (and TP 2 x DP 2) CPU ranks, two microbatches, and compares the
router weight's gradient with float64 gradients of the definition computed in this process.

- Fork: every case within 1e-5 (relative; the grad buffers are float32) of the definition;
  ``aux_loss`` as the control.
- Pristine (counterfactual, DP 2): the global-aux cases miss the definition (under the mean loss
  they equal the model of what upstream computes, ``upstream-mean``), but for two per-token
  cases it gets right by accident.
"""

import pytest
import torch

from tests.harness import bases, call
from tests.scenarios import global_aux_loss as g

S = 'tests.scenarios.global_aux_loss:scenario_global_aux'
PATTERNS = ('uneven', 'even', 'skewdp', 'none')
CASES = [
    dict(name=f'{loss}-{"pt" if pt else "mean"}-{pat}', loss=loss, per_token=pt, pattern=pat)
    for loss in ('aux_loss', 'global_aux_loss')
    for pt in (False, True)
    for pat in PATTERNS
]
# Two steps in one run: the tracker's reset between them must restart the running counts.
CASES += [
    dict(c, name=c['name'] + '-2steps', steps=2)
    for c in CASES
    if c['loss'] == 'global_aux_loss' and c['pattern'] == 'uneven'
]
TP2_CASES = [
    dict(c, name=c['name'] + '-tp2', tp=2)
    for c in CASES
    if c['loss'] == 'global_aux_loss' and c['pattern'] in ('uneven', 'none')
]
RUNS = {
    (tree, world): call(world, tree, S, cases=cases, timeout=300)
    for tree, world, cases in (
        (bases.FORK, 2, CASES),
        (bases.FORK, 4, TP2_CASES),
        (bases.PRISTINE, 2, CASES),  # the counterfactual needs no TP 2 (CI's time)
    )
}


def _rows(tree, world, name):
    per_rank = RUNS[(tree, world)].result()
    rows = []
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
        [row] = [c for c in res['cases'] if c['name'] == name]
        assert 'error' not in row, f'rank {rank}: {row["error"]}'
        rows.append(row)
    return rows


def _logged(tree, world, name):
    """Per step and microbatch: the global aux loss as handed to the logging (over its
    coefficient), summed over the ranks (each holds its share)."""
    rows = _rows(tree, world, name)
    return [[sum(per_mb) for per_mb in zip(*step)] for step in zip(*(r['logged'] for r in rows))]


def _grad(tree, world, name):
    rows = [torch.tensor(r['grad'], dtype=torch.float64) for r in _rows(tree, world, name)]
    for rank, row in enumerate(rows[1:], 1):  # every DP and TP rank holds the same reduced grad
        assert torch.equal(row, rows[0]), f'rank {rank} differs from rank 0'
    return rows[0]


def _rel(got, ref):
    ref = torch.tensor(ref, dtype=torch.float64)
    return float((got - ref).norm() / ref.norm())


def _params(cases, world):
    return [pytest.param(c, world, id=c['name']) for c in cases]


ALL = _params(CASES, 2) + _params(TP2_CASES, 4)
GLOBAL = [p for p in ALL if 'global' in p.id]


@pytest.mark.parametrize('case,world', ALL)
def test_fork_router_grad_is_the_definitions(case, world):
    ref = g.reference(case['loss'], case['per_token'], case['pattern'])
    assert _rel(_grad(bases.FORK, world, case['name']), ref) < 1e-5


# Pristine is right by accident here: with a padding mask at TP x CP = 1 the per-token rescale
# reads the global count (the TP reduce overwrote the local one), and every microbatch holds as
# many valid tokens over the DP ranks, so (a) does not show.
PRISTINE_RIGHT = {'global_aux_loss-pt-even', 'global_aux_loss-pt-skewdp'}


PRISTINE_GLOBAL = [p for p in GLOBAL if p.values[1] == 2]


@pytest.mark.parametrize('case,world', PRISTINE_GLOBAL)
def test_pristine_global_aux_loss(case, world):
    got = _grad(bases.PRISTINE, world, case['name'])
    ref = g.reference(case['loss'], case['per_token'], case['pattern'])
    if case['name'] in PRISTINE_RIGHT:
        assert _rel(got, ref) < 1e-5
        return
    assert _rel(got, ref) > 0.05
    if not case['per_token'] and world == 2:
        # exactly what upstream computes: (a) and each rank's share averaged over DP (b)
        model = g.reference(case['loss'], False, case['pattern'], 'upstream-mean')
        assert _rel(got, model) < 1e-5


@pytest.mark.parametrize('case,world', GLOBAL)
def test_fork_logged_value_is_the_definitions(case, world):
    """What the metrics tracker is handed is the loss's value (L_m summed over the ranks'
    shares): the gradient's DP factor leaves it alone."""
    ref = g.reference_values(case['pattern'])
    for step in _logged(bases.FORK, world, case['name']):
        assert step == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize('case,world', [p for p in PRISTINE_GLOBAL if 'uneven' in p.id])
def test_pristine_logged_value_misses_the_definition(case, world):
    ref = g.reference_values(case['pattern'])
    [step] = _logged(bases.PRISTINE, world, case['name'])[:1]
    assert step[0] == pytest.approx(ref[0], rel=1e-5)  # the first microbatch is right
    assert abs(step[1] / ref[1] - 1) > 0.05  # (a)


AUX = [pytest.param(c, id=c['name']) for c in CASES if c['loss'] == 'aux_loss']


@pytest.mark.parametrize('case', AUX)
def test_pristine_aux_loss_control_holds(case):
    """The per-rank aux_loss is right on pristine too: the reference and harness are sound."""
    ref = g.reference(case['loss'], case['per_token'], case['pattern'])
    assert _rel(_grad(bases.PRISTINE, 2, case['name']), ref) < 1e-5
