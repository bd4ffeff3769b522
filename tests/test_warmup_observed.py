"""What the warmup's steps do, and what the first real iterations see after them, through
upstream's pretrain_gpt.py and the real pretrain() (patch 0004, `training-warmup-train-steps`).

tests/test_warmup.py compares the state restored after the warmup; these tests look at what a user
sees instead, comparing a run with --warmup-train-steps 2 against the same run without it (world
2, DP 2, both on the fork):

- 'opg' (distributed optimizer with overlap_param_gather): the real batches are the warmup's own
  synthetic stream (``warmup.synthetic_gpt_batches``). A warmup step is a training step: warmup
  step k must give, bitwise, the loss that real step k gives without warmup. Step 2 trains on the
  params that step 1's optimizer updated only if the forward pre-hooks (which all-gather them)
  are enabled again after step 1.
- 'moe' (two MoE layers plus one MTP layer with MoE, aux-loss load balancing, the aux-loss-free
  expert bias, --check-for-spiky-loss): the values training_log prints for the first real
  iterations (lm loss, load_balancing_loss, mtp_1 loss) must be the no-warmup run's, so the
  warmup's aux losses are not logged with iteration 1; every module buffer (the routers'
  expert_bias and local_tokens_per_expert) after each real step must be the no-warmup run's
  bitwise; and the rerun state machine (whose spiky-loss statistics a checkpoint saves) must be
  at the first real step and end as without warmup.
- 'packed': a forward step that accounts packed sequences (as pretrain_gpt's does for THD
  batches): every iteration's FLOPs as without warmup.

Three of these tests found warmup bugs, fixed since: the rerun state machine's validation
statistics, the packed-sequence statistics that train_step() accumulates for the FLOPs, and (on
dev) the MTP per-token loss sums were left as the warmup steps made them.
"""

import re

import pytest

from tests.harness import bases, call
from tests.scenarios.pretrain import driver_params, drivers_here, tiny_gpt_args
from tests.scenarios.warmup_observed import results_of

S = 'tests.scenarios.warmup_observed:scenario_observe'
REF = bases.upstream_ref()
ITERS = 3
WARMUP = ['--warmup-train-steps', '2']
MOE = [
    '--num-experts', '2',
    '--moe-router-topk', '1',
    '--moe-router-load-balancing-type', 'aux_loss',
    '--moe-aux-loss-coeff', '0.01',
    '--moe-router-score-function', 'sigmoid',
    '--moe-router-enable-expert-bias',
    '--moe-router-dtype', 'fp32',
    '--moe-token-dispatcher-type', 'allgather',
    '--mtp-num-layers', '1',
    '--position-embedding-type', 'rope',  # MTP needs rope (or none)
    '--no-rope-fusion',
    '--disable-bias-linear',
    '--check-for-spiky-loss',
]  # fmt: skip
LAYOUTS = {
    # No lr warmup: step 1 already moves the params (with lr 0 it would leave them as they were).
    'opg': (
        tiny_gpt_args(2, ITERS) + ['--overlap-param-gather', '--lr-warmup-iters', '0'],
        {'batches': True},
    ),
    'moe': (tiny_gpt_args(2, ITERS) + MOE, {}),
    'packed': (tiny_gpt_args(2, ITERS), {'packed_stats': True}),
}
RUNS = {
    (driver, layout, arm): call(
        2,
        bases.FORK,
        S,
        argv=argv + (WARMUP if arm == 'warmup' else []),
        driver=driver,
        tag=REF,
        timeout=240,
        **opts,
    )
    for driver in drivers_here()
    for layout, (argv, opts) in LAYOUTS.items()
    for arm in ('none', 'warmup')
}


@pytest.fixture(params=driver_params())
def driver(request):
    """The GPT entry point: the project's driver, and upstream's in the megatron-lm tier."""
    return request.param


def _ok(layout, arm, driver):
    return results_of(RUNS[(driver, layout, arm)])


def _steps(res, kind):
    return [step for step in res['steps'] if step['kind'] == kind]


def test_warmup_steps_train_as_real_steps(driver):
    """Warmup step k on batch k gives real step k's loss (no warmup, same batches), bitwise."""
    for rank, (none, warm) in enumerate(
        zip(_ok('opg', 'none', driver), _ok('opg', 'warmup', driver))
    ):
        real = [step['loss'] for step in _steps(none, 'real')]
        warmup = [step['loss'] for step in _steps(warm, 'warmup')]
        assert len(real) == ITERS and len(warmup) == 2, f'rank {rank}'
        assert all(step['lm loss'] for step in real), f'rank {rank}'  # every rank is a last stage
        assert warmup == real[:2], f'rank {rank}'
        # ... and the real steps after the warmup are the no-warmup run's.
        assert [step['loss'] for step in _steps(warm, 'real')] == real, f'rank {rank}'
        assert len(set(map(str, real))) == ITERS, f'rank {rank}'
        # Step 1 updates the params with a non-zero lr, so step 2 sees them only if they were
        # all-gathered after it.
        assert float.fromhex(none['iterations'][0]['lr'][0]) > 0, f'rank {rank}'


def _printed(key, driver):
    """{iteration: printed value of key} without and with warmup (the last rank prints)."""
    none, warm = _ok('moe', 'none', driver)[-1], _ok('moe', 'warmup', driver)[-1]
    out = []
    for res in (none, warm):
        printed = {int(k): v for k, v in res['printed'].items()}
        assert sorted(printed) == list(range(1, ITERS + 1))
        assert all(key in printed[it] for it in printed), key
        out.append({it: printed[it][key] for it in printed})
    return out


@pytest.mark.parametrize('key', ['lm loss', 'load_balancing_loss'])
def test_first_real_iterations_log_no_warmup_losses(key, driver):
    """training_log prints the no-warmup run's loss and MoE aux loss from iteration 1 on."""
    none, warm = _printed(key, driver)
    assert warm == none


def test_moe_warmup_runs_the_expert_gemm_shapes(driver):
    """Change training-warmup-expert-gemms: after the warmup steps train() runs the experts' GEMM
    shapes (on CPU ranks too: tests/scenarios/pretrain.py) and logs them; 2 experts, top-1, 64
    tokens a rank: every count 1-64, fc1 and fc2, 3 GEMMs each. The run without the flag runs
    none. The 'moe' tests around this one find the real iterations as without the warmup."""
    line = (
        r'\[warmup\] Ran 384 routed-expert GEMM shapes in [\d.]+s: 1-64 tokens an expert '
        r'\(of up to 64, mean 32\), 2 weight shapes, cuBLAS heuristics cache of \d+$'
    )
    none, warm = _ok('moe', 'none', driver)[0], _ok('moe', 'warmup', driver)[0]
    gemms = [entry for entry in warm['warmup_log'] if 'GEMM' in entry]
    assert len(gemms) == 1 and re.match(line, gemms[0]), warm['warmup_log']
    assert warm['warmup_log'][-1] == gemms[0]  # the last thing before the first real step
    assert none['warmup_log'] == []


def test_first_real_iteration_logs_no_warmup_mtp_loss(driver):
    """training_log prints the no-warmup run's MTP loss from iteration 1 on."""
    none, warm = _printed('mtp_1 loss', driver)
    assert warm == none


def test_router_buffers_after_each_real_step_as_without_warmup(driver):
    """expert_bias (updated by finalize_model_grads) and the tokens-per-expert counts."""
    for rank, (none, warm) in enumerate(
        zip(_ok('moe', 'none', driver), _ok('moe', 'warmup', driver))
    ):
        real = [step['buffers'] for step in _steps(none, 'real')]
        assert any('expert_bias' in name for name in real[0]), f'rank {rank}'
        # The expert bias moves during training: the comparison is not of constants.
        bias = [name for name in real[0] if name.endswith('expert_bias')]
        assert real[0][bias[0]] != none['buffers_before'][bias[0]], f'rank {rank}'
        assert warm['buffers_before'] == none['buffers_before'], f'rank {rank}'
        assert [step['buffers'] for step in _steps(warm, 'real')] == real, f'rank {rank}'
        assert [step['loss'] for step in _steps(warm, 'real')] == [
            step['loss'] for step in _steps(none, 'real')
        ], f'rank {rank}'


def test_rerun_state_machine_as_without_warmup(driver):
    """The spiky-loss baseline (saved in checkpoints) and the first-iteration flag."""
    for rank, (none, warm) in enumerate(
        zip(_ok('moe', 'none', driver), _ok('moe', 'warmup', driver))
    ):
        assert none['rerun']['large_value_counts'], f'rank {rank}'  # --check-for-spiky-loss ran
        # Upstream validates no result of the first iteration (no checkpoint to rerun from yet).
        first = _steps(none, 'real')[0]['rerun_before']
        assert first['first_iteration_complete'] is False, f'rank {rank}'
        assert _steps(warm, 'real')[0]['rerun_before'] == first, f'rank {rank}'
        assert warm['rerun'] == none['rerun'], f'rank {rank}'


def test_flops_counted_per_iteration_as_without_warmup(driver):
    """A forward step that accounts packed sequences (as pretrain_gpt's does for THD batches):
    train() counts every iteration's FLOPs (and from them num_floating_point_operations_so_far,
    saved in checkpoints, and the logged throughput) as without warmup."""
    for rank, (none, warm) in enumerate(
        zip(_ok('packed', 'none', driver), _ok('packed', 'warmup', driver))
    ):
        assert len(none['flops']) >= ITERS, f'rank {rank}'
        assert warm['flops'] == none['flops'], f'rank {rank}'
