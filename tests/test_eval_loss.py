"""The validation loss with ``--sft`` is the token-weighted mean (Megatron-LM PR 7207's bug).

``evaluate()`` adds up the loss function's ``[loss sum, valid tokens]`` over microbatches, DP x CP
ranks and evaluation iterations and divides once: the mean loss over every evaluated token, the
statistic the training loss is too. With ``--sft`` upstream instead averages per-microbatch means
with equal weights, over the microbatches of a rank, then over the DP x CP ranks, then over the
iterations, so a microbatch with 2 valid tokens counts as much as one with 2000.

The runs go through upstream's real ``pretrain()`` (tests/scenarios/pretrain.py, the tiny GPT on
CPU ranks), DP 2, two microbatches per rank and iteration, two evaluation iterations, with
``--eod-mask-loss`` so that the mock documents' end-of-document tokens leave every microbatch a
different count of valid tokens. ``--sft`` changes nothing in training, so each arm's run with
and without it evaluates the same model on the same batches; the run without it is upstream's
own token-weighted sum, the reference computed in the same test.

- Fork: with ``--sft`` every evaluation equals the one without it, bitwise.
- Pristine (counterfactual): with ``--sft`` the printed value differs (the mean of means).
"""

import pytest

from tests.harness import bases, call
from tests.scenarios.pretrain import tiny_gpt_args

S = 'tests.scenarios.pretrain:scenario_pretrain_gpt'
WS = 2
# Every claim compares runs of this file with each other (sft against no-sft, fork against
# pristine), never a reference value: the non-native-capability pass of tools/test.sh skips it.
pytestmark = pytest.mark.same_run_bitwise


def _argv(sft):
    argv = tiny_gpt_args(WS, train_iters=4)
    for flag, value in (('--split', '80,20,0'), ('--eval-iters', '2'), ('--eval-interval', '4')):
        argv[argv.index(flag) + 1] = value
    return argv + ['--eod-mask-loss'] + (['--sft'] if sft else [])


RUNS = {
    (tree, sft): call(WS, tree, S, argv=_argv(sft), timeout=300)
    for tree in (bases.FORK, bases.PRISTINE)
    for sft in (False, True)
}


def _evaluations(tree, sft):
    per_rank = RUNS[(tree, sft)].result()
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
        assert res['exit'] in (None, 0), f'rank {rank}: exit {res["exit"]}'
    evaluations = per_rank[-1]['evaluations']  # the last rank holds the loss (PP 1: every rank)
    assert evaluations, 'evaluate() never ran'
    return evaluations


def _value(evaluation):
    return float.fromhex(evaluation['lm loss'][0])


def test_fork_sft_eval_loss_is_token_weighted():
    assert [_value(e) for e in _evaluations(bases.FORK, True)] == [
        _value(e) for e in _evaluations(bases.FORK, False)
    ]


def test_pristine_sft_eval_loss_is_a_mean_of_means():
    sft = [_value(e) for e in _evaluations(bases.PRISTINE, True)]
    reference = [_value(e) for e in _evaluations(bases.PRISTINE, False)]
    assert len(sft) == len(reference)
    assert all(a != b for a, b in zip(sft, reference)), (sft, reference)
    # Without --sft the fork and pristine evaluate alike (the fork changes only the --sft path).
    assert reference == [_value(e) for e in _evaluations(bases.FORK, False)]
