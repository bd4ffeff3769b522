"""Upstream's real pretrain() with --warmup-train-steps (patch 0004), end to end.

Runs a GPT entry point through megatron.training.pretrain() (tests/scenarios/pretrain.py): the
project's own tests/driver/pretrain_tiny_gpt.py on every machine and, in the megatron-lm tier
(FORK_MEGATRON_LM names a clone), Megatron-LM's own pretrain_gpt.py at the selected base's ref
(never committed). Model provider, forward step, MockGPTDataset, a tiny local-spec GPT (2 layers,
hidden 64, seq 32, bf16, DDP with overlap_grad_reduce and the distributed optimizer, accumulation
2), on CPU ranks (gloo, with the harness's CUDA redirect plus its pretrain mode) at world sizes 1
and 2, or on GPUs with FORK_TEST_BACKEND=nccl.

- Without the flag and with --warmup-train-steps 2, every real iteration's loss, grad norm,
  learning rate and loss scale are bitwise identical, and so are the model and optimizer after the
  last iteration.
- The warmup really ran: train() called run_warmup once with 2 steps, at its start (before any
  real train_step and before its interval timer existed), and logged its report lines.
- Counterfactual: the pristine base rejects the flag with argparse's exact error (exit 2); without
  the flag it trains exactly as the fork does.
"""

import pytest

from tests.harness import bases, call
from tests.scenarios.pretrain import driver_params, driver_script_name, drivers_here, tiny_gpt_args

S = 'tests.scenarios.pretrain:scenario_pretrain_gpt'
FORK = bases.FORK
PRISTINE = bases.PRISTINE
REF = bases.upstream_ref()  # pretrain_gpt.py and its helpers at the base's own version
ITERS = 4
WARMUP = ['--warmup-train-steps', '2']
ARMS = {'none': [], 'warmup': WARMUP}


def _argv(ws, arm):
    return tiny_gpt_args(ws, train_iters=ITERS) + ARMS[arm]


RUNS = {
    (driver, ws, arm): call(ws, FORK, S, argv=_argv(ws, arm), driver=driver, tag=REF, timeout=300)
    for driver in drivers_here()
    for ws in (1, 2)
    for arm in ARMS
}
PRISTINE_FLAG = {
    d: call(1, PRISTINE, S, argv=_argv(1, 'warmup'), driver=d, tag=REF, timeout=120)
    for d in drivers_here()
}
PRISTINE_NONE = {
    d: call(1, PRISTINE, S, argv=_argv(1, 'none'), driver=d, tag=REF, timeout=300)
    for d in drivers_here()
}
DRIVERS = driver_params()


def _ok(handle):
    per_rank = handle.result()
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
        assert res['exit'] in (None, 0), f'rank {rank}: exit {res["exit"]}'
    return per_rank


def _trained(res):
    """The per-iteration record without anything that may legitimately differ."""
    return res['iterations'], res['final_model'], res['final_optimizer']


@pytest.mark.parametrize('driver', DRIVERS)
@pytest.mark.parametrize('ws', [1, 2])
def test_pretrain_gpt_trains(ws, driver):
    for res in _ok(RUNS[(driver, ws, 'none')]):
        assert [it['iteration'] for it in res['iterations']] == list(range(1, ITERS + 1))
        losses = [float.fromhex(it['losses']['lm loss'][0]) for it in res['iterations']]
        assert all(0 < loss < 10 for loss in losses), losses
        assert all(it['skipped'] == 0 for it in res['iterations'])
        # train() calls the warmup on the fork, which runs no step without the flag.
        assert all(call['steps'] == 0 for call in res['warmup_calls'])
        assert res['warmup_log'] == []


@pytest.mark.parametrize('driver', DRIVERS)
@pytest.mark.parametrize('ws', [1, 2])
def test_warmup_through_pretrain_is_bitwise_invisible(ws, driver):
    none = _ok(RUNS[(driver, ws, 'none')])
    warm = _ok(RUNS[(driver, ws, 'warmup')])
    for rank, (a, b) in enumerate(zip(none, warm)):
        assert b['iterations'] == a['iterations'], f'rank {rank}'
        assert _trained(b) == _trained(a), f'rank {rank}'
        assert b['final_scheduler_steps'] == a['final_scheduler_steps'], f'rank {rank}'


@pytest.mark.parametrize('driver', DRIVERS)
@pytest.mark.parametrize('ws', [1, 2])
def test_warmup_ran_at_the_start_of_train(ws, driver):
    for rank, res in enumerate(_ok(RUNS[(driver, ws, 'warmup')])):
        # Inside train(), before any real step read a batch and before its interval timer (so no
        # logged iteration contains the warmup).
        assert res['warmup_calls'] == [
            {
                'steps': 2,
                'inside_train': True,
                'real_train_steps_before': 0,
                'interval_timer_before': False,
            }
        ], f'rank {rank}'
        if rank == 0:
            reset, ran = res['warmup_log']
            assert reset.startswith('[warmup] Reset DDP grad-ready calibration on ')
            groups = reset.split(' calibration on ')[1].split(' ')[0]
            assert reset.endswith(
                f' bucket groups (0 outstanding collectives drained; calibration kept on {groups})'
            )
            assert ran.startswith('[warmup] Ran 2 warmup train steps in ')
        else:
            assert res['warmup_log'] == []


@pytest.mark.parametrize('driver', DRIVERS)
def test_pristine_rejects_the_flag(driver):
    for res in PRISTINE_FLAG[driver].result():
        assert 'error' not in res, res['error']
        assert res['exit'] == 2
        assert res['argparse_error'] == (
            f'{driver_script_name(driver)}: error: unrecognized arguments: --warmup-train-steps 2'
        )
        assert res['iterations'] == []


@pytest.mark.parametrize('driver', DRIVERS)
def test_fork_without_the_flag_trains_as_pristine(driver):
    (pristine,) = _ok(PRISTINE_NONE[driver])
    (fork,) = _ok(RUNS[(driver, 1, 'none')])
    assert _trained(fork) == _trained(pristine)
