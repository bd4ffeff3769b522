"""Issue 38 / change ``training-warmup-expert-gemms``: after the warmup steps, the routed experts'
GEMM shapes run once, so that a MoE run's first real iterations do not pay cuBLAS's per-shape
kernel choice (a new shape's first call costs several times a repeat's host time on the GPU;
numbers: docs/warmup.md).

CPU stand-in for what cuBLAS caches: the configuration of each ``aten.mm`` (operand shapes,
strides, dtypes) of one MoE layer's experts (tests/scenarios/warmup_expert_gemms.py):
- the problem: two steps on random batches (what the warmup's steps are) leave GEMMs of the
  real run new: a step whose routing sends every token to two experts (32 tokens each) issues
  expert GEMMs none of theirs had;
- the fix: the warmup's plan issues every expert GEMM of that step and of the random ones, in the
  layouts the layer's local linears use (forward, input gradient, weight gradient), and leaves
  the layer's params, grads and the RNG as they were;
- the plan: the token counts an expert is likeliest to get (its mean share, outward), the
  likeliest last, as many as fit cuBLAS's cache less the room kept for the rest of the model
  (``CUBLASLT_HEURISTICS_CACHE_CAPACITY`` read); two GEMMs a weight where the fused weight-gradient
  kernel does the third; only the local linear layers' weights; nothing for a dense layer or on
  a device that is not cuBLAS's. Token bounds under EP, SP with TP, CP and the capacity factor.
Through pretrain(): tests/test_pretrain.py (the log line, a MoE run bitwise the same as without
the warmup).
"""

import pytest

from tests.harness import call
from tests.harness.bases import FORK

SIG = call(1, FORK, 'tests.scenarios.warmup_expert_gemms:scenario_signatures')
PLAN = call(1, FORK, 'tests.scenarios.warmup_expert_gemms:scenario_plan')


def _result(handle):
    [res] = handle.result()
    assert 'error' not in res, res['error']
    return res


def _set(calls):
    return {
        tuple(tuple(tuple(x) if isinstance(x, list) else x for x in op) for op in c) for c in calls
    }


def test_random_batches_leave_gemms_of_the_real_run_new():
    res = _result(SIG)
    warm, real = _set(res['warm']), _set(res['real'])
    assert warm and real
    assert real - warm, 'the random batches already issued every expert GEMM of the real step'
    # every token to two experts: 32 tokens an expert, in the forward GEMM of fc1
    assert (((32, 8), (8, 1), 'torch.float32'), ((8, 40), (1, 8), 'torch.float32')) in real


def test_plan_issues_every_expert_gemm_and_changes_nothing():
    res = _result(SIG)
    plan = _set(res['plan'])
    missing = (_set(res['real']) | _set(res['warm'])) - plan
    assert not missing, sorted(missing)
    assert res['ran'] == res['num_gemms'] == res['plan_mm'] == len(plan) == 2 * 3 * 32
    assert res['unchanged']


def test_plan_order_room_and_scope():
    res = _result(PLAN)
    default = res['default']
    assert default['weights'] == [[8, 20], [40, 8]]
    assert (default['max'], default['mean'], default['ops']) == (32, 16.0, 3)
    assert sorted(default['counts']) == list(range(1, 33))
    assert default['counts'][0] == 32 and default['counts'][-3:] == [15, 17, 16]
    assert res['room5']['counts'] == [14, 18, 15, 17, 16]
    assert res['room5']['num_gemms'] == 2 * 3 * 5
    assert res['no_room']['counts'] == [] and res['no_room']['num_gemms'] == 0
    assert res['fused_wgrad']['ops'] == 2
    assert res['fused_wgrad']['num_gemms'] == 2 * 2 * len(res['fused_wgrad']['counts'])
    assert res['two_chunks'] == default
    assert res['dense']['weights'] == [] and res['dense']['num_gemms'] == 0
    assert res['other_fc1']['weights'] == [[8, 20]]
    assert res['prewarm_cpu'] == {'num_gemms': 0, 'seconds': 0.0}


@pytest.mark.parametrize(
    'layout, bounds',
    [
        ('plain', [32, 16.0]),
        ('ep2', [64, 32.0]),
        # the router sees 16 tokens a rank; the dispatcher gathers them over the TP x EP group
        ('sp_tp2', [32, 16.0]),
        ('sp_tp2_etp1', [16, 8.0]),
        ('tp2_no_sp', [64, 32.0]),  # every TP rank routes all 32: gathered twice
        ('cp2', [16, 8.0]),
        ('capacity', [24, 16.0]),
        ('capacity_rounded_up', [18, 16.0]),  # 17.6 rounded up (upstream's get_capacity)
        ('capacity_padded', [24, 24.0]),
        ('ep2_capacity_padded', [34, 34.0]),  # 17 a rank (16.32 rounded up) from 2 ranks
    ],
)
def test_token_bounds(layout, bounds):
    assert _result(PLAN)['bounds'][layout] == bounds
