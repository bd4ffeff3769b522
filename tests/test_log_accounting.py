"""The printed loss of each iteration is that iteration's own (patch 0018).

A GPT entry point through the real pretrain() (tests/scenarios/pretrain.py: the project's driver,
and upstream's pretrain_gpt.py in the megatron-lm tier) with
--log-interval 1: training_log prints one line per iteration. Pristine keeps the first
iteration in its accumulators, so its second line is the mean of iterations 1 and 2; the fork
prints each iteration's own loss. With --log-interval 2 the line at iteration 2 is the mean of
both on either tree (the first iteration is not on a boundary there). The warmup's claims
compare the recorded per-iteration losses; this file pins that the printed ones agree.
"""

import atexit
import shutil
import tempfile

import pytest
import torch

from tests.harness import bases, call
from tests.scenarios.pretrain import driver_params, drivers_here, tiny_gpt_args

S = 'tests.scenarios.pretrain:scenario_pretrain_gpt'
REF = bases.upstream_ref()
ITERS = 3


def _argv(log_interval):
    argv = tiny_gpt_args(1, train_iters=ITERS)
    i = argv.index('--log-interval')
    return argv[: i + 1] + [str(log_interval)] + argv[i + 2 :]


RUNS = {
    (driver, tree, interval): call(
        1, tree, S, argv=_argv(interval), driver=driver, tag=REF, timeout=300
    )
    for driver in drivers_here()
    for tree in (bases.FORK, bases.PRISTINE)
    for interval in (1, 2)
}
DRIVERS = driver_params()


def _run(driver, tree, interval):
    (res,) = RUNS[(driver, tree, interval)].result()
    assert 'error' not in res and res['exit'] in (None, 0), res.get('error', res['exit'])
    own = [float.fromhex(it['losses']['lm loss'][0]) for it in res['iterations']]
    printed = {int(k): float(v) for k, v in res['printed_loss'].items()}
    return own, printed


def _as_printed(value):
    return float(f'{value:.6E}')


def _mean(a, b):
    """The mean as training_log computes it: a float32 sum, divided in Python."""
    return (torch.tensor([a]) + torch.tensor([b])).item() / 2.0


@pytest.mark.parametrize('driver', DRIVERS)
def test_fork_prints_each_iterations_own_loss_at_log_interval_1(driver):
    own, printed = _run(driver, bases.FORK, 1)
    assert printed == {i + 1: _as_printed(loss) for i, loss in enumerate(own)}


@pytest.mark.parametrize('driver', DRIVERS)
def test_pristine_prints_the_mean_of_iterations_1_and_2_at_iteration_2(driver):
    own, printed = _run(driver, bases.PRISTINE, 1)
    assert printed[1] == _as_printed(own[0])
    assert printed[2] == _as_printed(_mean(own[0], own[1])) != _as_printed(own[1])


@pytest.mark.parametrize('driver', DRIVERS)
def test_both_average_the_whole_interval_at_log_interval_2(driver):
    for tree in (bases.FORK, bases.PRISTINE):
        own, printed = _run(driver, tree, 2)
        assert printed == {1: _as_printed(own[0]), 2: _as_printed(_mean(own[0], own[1]))}, tree
    # Same training on both trees.
    assert _run(driver, bases.FORK, 1)[0] == _run(driver, bases.PRISTINE, 1)[0]


# A resumed run whose first iteration falls on a boundary of a larger interval: the first run
# saves at iteration 3 and exits; the second loads it and logs iterations 4..8 at interval 4, so its
# first iteration (4) is on a boundary and its next line (8) must average 5..8 alone. A reset
# keyed to --log-interval 1 instead of the boundary passes the fresh-run tests above, not this.
RESUME_ITERS, RESUME_AT, RESUME_INTERVAL = 8, 3, 4


def _resume_argv(ckpt, phase):
    argv = tiny_gpt_args(1, train_iters=RESUME_ITERS, distopt=False)
    i = argv.index('--log-interval')
    argv = argv[: i + 1] + [str(RESUME_INTERVAL)] + argv[i + 2 :]
    argv += ['--ckpt-format', 'torch', '--save', ckpt, '--save-interval', str(RESUME_AT)]
    # Without dropout: the fork's resumed run keeps its restored RNG streams (changes
    # resume-host-rng-data-iterators, rng-state-per-rank) where pristine's moves them, so only
    # a run that draws nothing trains the same on both trees.
    argv += ['--hidden-dropout', '0', '--attention-dropout', '0']
    if phase == 'first':
        return argv + ['--exit-interval', str(RESUME_AT)]
    return argv + ['--load', ckpt]


def _resume_calls(driver, tree):
    ckpt = tempfile.mkdtemp(prefix='log-accounting-ckpt-')
    atexit.register(shutil.rmtree, ckpt, ignore_errors=True)
    # One world runs its calls in order: the first phase saves before the second loads.
    return tuple(
        call(1, tree, S, argv=_resume_argv(ckpt, phase), driver=driver, tag=REF, timeout=300)
        for phase in ('first', 'resumed')
    )


RESUMED = {
    (driver, tree): _resume_calls(driver, tree)
    for driver in drivers_here()
    for tree in (bases.FORK, bases.PRISTINE)
}


def _resumed(driver, tree):
    first, resumed = (h.result()[0] for h in RESUMED[(driver, tree)])
    for res in (first, resumed):
        assert 'error' not in res and res['exit'] in (None, 0), res.get('error', res['exit'])
    assert [it['iteration'] for it in first['iterations']] == [1, 2, 3]
    assert [it['iteration'] for it in resumed['iterations']] == [4, 5, 6, 7, 8]
    own = {
        it['iteration']: float.fromhex(it['losses']['lm loss'][0]) for it in resumed['iterations']
    }
    printed = {int(k): float(v) for k, v in resumed['printed_loss'].items()}
    return own, printed


def _interval_mean(own, first, last):
    """training_log's mean over iterations first..last: float32 running sum, divided in Python."""
    total = torch.zeros(1)
    for it in range(first, last + 1):
        total = total + torch.tensor([own[it]])
    return total.item() / (last - first + 1)


@pytest.mark.parametrize('driver', DRIVERS)
def test_resumed_run_starting_on_a_boundary_prints_each_interval_once(driver):
    own, printed = _resumed(driver, bases.FORK)
    assert printed == {4: _as_printed(own[4]), 8: _as_printed(_interval_mean(own, 5, 8))}


@pytest.mark.parametrize('driver', DRIVERS)
def test_pristine_resumed_run_counts_its_first_iteration_twice(driver):
    own, printed = _resumed(driver, bases.PRISTINE)
    assert printed[4] == _as_printed(own[4])
    assert printed[8] == _as_printed(_interval_mean(own, 4, 8))
    assert printed[8] != _as_printed(_interval_mean(own, 5, 8))
    assert own == _resumed(driver, bases.FORK)[0]  # the same training on both trees
