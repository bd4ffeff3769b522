"""Megatron-FSDP grad accumulation into a one-rank grad buffer (Megatron-LM issue 6660).

tests/scenarios/mfsdp_one_rank_grads.py runs the tree's ``fully_shard_model`` with
``optim_grads_params`` in a world of one rank (every grad buffer unsharded) over N microbatches
and compares the accumulated main grads with the float64 sum of the microbatch grads.

- Fork: every case equals the reference within a bound computed in the same run: the float32
  eager copy's distance, plus one bf16 rounding of the sum where the comm dtype is bf16. Also
  one microbatch without ``no_sync`` (the reduction waits for ``finish_grad_sync``), two cycles,
  and the default fused division (a one-rank reduction scales explicitly, no PREMUL_SUM).
- Pristine (counterfactual): with a bf16 comm dtype the buffer is added to its reduced copy on
  every backward (ratio > 1.5: about 2^N weighted, 2 even at N = 1); with a scale of 0.5 the
  early microbatches are rescaled on every backward (ratio < 0.7); default dtypes at scale 1
  are right (the control), as is a scale with one microbatch.
"""

import pytest

from tests.harness import bases, call

S = 'tests.scenarios.mfsdp_one_rank_grads:scenario_mfsdp_one_rank_grads'
COMM = dict(main_grads_dtype='fp32', grad_comm_dtype='bf16')
CASES = [
    dict(name='control-3', n_micro=3),
    dict(name='control-4', n_micro=4),
    dict(name='comm-3', n_micro=3, **COMM),
    dict(name='comm-4', n_micro=4, **COMM),
    dict(name='comm-1', n_micro=1, cycles=2, **COMM),
    dict(name='scale-3', n_micro=3, grad_scale=0.5),
    dict(name='scale-4', n_micro=4, grad_scale=0.5),
    dict(name='scale-1', n_micro=1, cycles=2, grad_scale=0.5),
]
# The default fused division picks PREMUL_SUM, which gloo lacks: fork only (no PREMUL_SUM on a
# one-rank group).
FUSED = [dict(name='scale-fused-3', n_micro=3, grad_scale=0.5, div_fusion=True)]
RUNS = {
    bases.FORK: call(1, bases.FORK, S, cases=CASES + FUSED, timeout=120),
    bases.PRISTINE: call(1, bases.PRISTINE, S, cases=CASES, timeout=120),
}


def _row(tree, name):
    [res] = RUNS[tree].result()
    assert 'error' not in res, res['error']
    [row] = [c for c in res['cases'] if c['name'] == name]
    assert 'error' not in row, row['error']
    assert row['groups'] and all(g['dp'] == 1 and not g['distributed'] for g in row['groups'])
    return row


def _bound(row):
    bf16 = row['bf16_round_rel_err'] if row['name'].startswith('comm') else 0.0
    return 4 * row['eager32_rel_err'] + 1.5 * bf16


@pytest.mark.parametrize('name', [c['name'] for c in CASES + FUSED])
def test_fork_one_rank_grads_match_the_reference(name):
    row = _row(bases.FORK, name)
    assert row['rel_err'] <= _bound(row), row


@pytest.mark.parametrize('name', ['comm-3', 'comm-4', 'comm-1'])
def test_pristine_comm_dtype_adds_the_buffer_to_itself(name, record_property):
    row = _row(bases.PRISTINE, name)
    record_property('ratio', row['ratio'])
    assert row['ratio_min'] > 1.5, row


@pytest.mark.parametrize('name', ['scale-3', 'scale-4'])
def test_pristine_scale_rescales_early_microbatches(name, record_property):
    row = _row(bases.PRISTINE, name)
    record_property('ratio', row['ratio'])
    assert row['ratio_max'] < 0.7, row


@pytest.mark.parametrize('name', ['control-3', 'control-4', 'scale-1'])
def test_pristine_control(name):
    row = _row(bases.PRISTINE, name)
    assert row['rel_err'] <= _bound(row), row
