"""The printed loss of each iteration is that iteration's own (patch 0018).

Upstream's pretrain_gpt.py through the real pretrain() (tests/scenarios/pretrain.py) with
--log-interval 1: training_log prints one line per iteration. Pristine keeps the first
iteration in its accumulators, so its second line is the mean of iterations 1 and 2; the fork
prints each iteration's own loss. With --log-interval 2 the line at iteration 2 is the mean of
both on either tree (the first iteration is not on a boundary there). The warmup's claims
compare the recorded per-iteration losses; this file pins that the printed ones agree.
"""

import torch

from tests.harness import bases, call
from tests.scenarios.pretrain import tiny_gpt_args

S = 'tests.scenarios.pretrain:scenario_pretrain_gpt'
REF = bases.upstream_ref()
ITERS = 3


def _argv(log_interval):
    argv = tiny_gpt_args(1, train_iters=ITERS)
    i = argv.index('--log-interval')
    return argv[: i + 1] + [str(log_interval)] + argv[i + 2 :]


RUNS = {
    (tree, interval): call(1, tree, S, argv=_argv(interval), tag=REF, timeout=300)
    for tree in (bases.FORK, bases.PRISTINE)
    for interval in (1, 2)
}


def _run(tree, interval):
    (res,) = RUNS[(tree, interval)].result()
    assert 'error' not in res and res['exit'] in (None, 0), res.get('error', res['exit'])
    own = [float.fromhex(it['losses']['lm loss'][0]) for it in res['iterations']]
    printed = {int(k): float(v) for k, v in res['printed_loss'].items()}
    return own, printed


def _as_printed(value):
    return float(f'{value:.6E}')


def _mean(a, b):
    """The mean as training_log computes it: a float32 sum, divided in Python."""
    return (torch.tensor([a]) + torch.tensor([b])).item() / 2.0


def test_fork_prints_each_iterations_own_loss_at_log_interval_1():
    own, printed = _run(bases.FORK, 1)
    assert printed == {i + 1: _as_printed(loss) for i, loss in enumerate(own)}


def test_pristine_prints_the_mean_of_iterations_1_and_2_at_iteration_2():
    own, printed = _run(bases.PRISTINE, 1)
    assert printed[1] == _as_printed(own[0])
    assert printed[2] == _as_printed(_mean(own[0], own[1])) != _as_printed(own[1])


def test_both_average_the_whole_interval_at_log_interval_2():
    for tree in (bases.FORK, bases.PRISTINE):
        own, printed = _run(tree, 2)
        assert printed == {1: _as_printed(own[0]), 2: _as_printed(_mean(own[0], own[1]))}, tree
    assert _run(bases.FORK, 1)[0] == _run(bases.PRISTINE, 1)[0]  # same training on both
