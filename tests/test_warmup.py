"""Pre-training warmup with exact state restore (patch 0004, megatron/training/warmup.py).

Real train_step, real DDP (overlap_grad_reduce), real Megatron optimizer and scheduler on CPU ranks.
Counterfactual: on pristine 0.18.2 a naive boundary warmup (train_step before train() installs
its callbacks, no restore) kills the first real step with the upstream DDP assertions, and the
warmup module does not exist; on the fork the warmup trains and the following real steps are
bitwise identical to a run without warmup.
"""

import pytest

from tests.harness import call

S = 'tests.scenarios.warmup:'
FORK = 'fork'
PRISTINE = 'pristine'

OUTSTANDING = 'AssertionError: Should not have multiple communication calls outstanding at once'
NOT_ISSUED = (
    'AssertionError: Communication call has not been issued for this bucket '
    '(2/2 params have grad available)'
)

# (accumulation, naive warmup installs finalize_model_grads?, expected pristine error)
E2E = [(1, False, OUTSTANDING), (2, True, NOT_ISSUED), (4, True, NOT_ISSUED)]


def _combo(acc, dtype, overlap, distopt, **extra):
    return dict(acc=acc, dtype=dtype, overlap=overlap, distopt=distopt, **extra)


# fp16 at upstream's default initial loss scale; the scaler grows after every good step.
LOSS_SCALE_2_32 = dict(initial_loss_scale=2.0**32, loss_scale_window=1)
COMBOS_DP2 = [
    _combo(1, 'bf16', True, True),
    _combo(2, 'bf16', True, True),
    _combo(2, 'fp32', True, False),
    _combo(1, 'fp32', False, True),
    _combo(2, 'bf16', False, False),
    _combo(2, 'bf16', True, True, overlap_param_gather=True),
    _combo(2, 'fp32', True, True, path='train'),
    # fp16: the dynamic grad scaler grows every 2 steps, so the warmup moves its scale.
    _combo(2, 'fp16', True, True, loss_scale_window=2),
    # A resumed run: scheduler, counters and optimizer state are non-zero before the warmup;
    # a frozen submodule in eval mode; train_step's dumps switched on.
    _combo(2, 'bf16', True, True, resume=2, eval_module='core.fc2', dumps=True),
    _combo(1, 'fp16', True, False, resume=2, loss_scale_window=2, path='train'),
    # fp16 at upstream's default initial loss scale (2**32): every step overflows until the
    # scaler has backed off. The warmup holds the scale at 1 so its steps reach the optimizer;
    # the scaler grows after every step (window 1), so the hold must be renewed for each step.
    _combo(2, 'fp16', True, True, **LOSS_SCALE_2_32),
]
COMBOS_DP1 = [
    _combo(2, 'bf16', True, True),
    _combo(1, 'fp32', True, False),
    _combo(2, 'bf16', True, True, overlap_param_gather=True, path='train'),
    # param_sync_func held back by train() for its first step: handed back held back.
    _combo(2, 'bf16', True, True, overlap_param_gather=True, align_param_gather=True),
    _combo(2, 'fp16', True, True, resume=3, loss_scale_window=2, dumps=True),
]
CONTROL = [
    _combo(2, 'bf16', True, True, **{'break': 'rng'}),
    # The warmup as it was before its loss scale hold: the scaler skipped every warmup step.
    _combo(2, 'fp16', True, True, **LOSS_SCALE_2_32, **{'break': 'loss_scale'}),
]

FORK_E2E = {
    (ws, acc): call(ws, FORK, S + 'scenario_end_to_end', arm='fork', accumulation=acc)
    for ws in (1, 2)
    for acc, _, _ in E2E
}
PRISTINE_E2E = {
    acc: call(
        2, PRISTINE, S + 'scenario_end_to_end', arm='naive', accumulation=acc, finalize=finalize
    )
    for acc, finalize, _ in E2E
}
PRISTINE_NO_MODULE = call(2, PRISTINE, S + 'scenario_end_to_end', arm='fork', accumulation=2)
EXACT = {
    2: call(2, FORK, S + 'scenario_exactness', combos=COMBOS_DP2 + CONTROL),
    1: call(1, FORK, S + 'scenario_exactness', combos=COMBOS_DP1),
}
# A fake clock: warmup steps of 5, 1, 2 and 6 s (median of the later ones 2 s, their mean 3 s);
# one step: no later step to compare with.
ONE_TIME_COST = {
    seconds: call(
        1,
        FORK,
        S + 'scenario_end_to_end',
        arm='fork',
        accumulation=1,
        warmup_steps=len(seconds),
        real_steps=1,
        step_seconds=list(seconds),
    )
    for seconds in ((5.0, 1.0, 2.0, 6.0), (5.0,))
}
FAULT = call(2, FORK, S + 'scenario_fault')
FAULT_RESTORE_FAILS = call(2, FORK, S + 'scenario_fault', restore_fails=True)
FAULT_RESUMED = call(2, FORK, S + 'scenario_fault', resume=2)
BAD_INPUT = call(1, FORK, S + 'scenario_bad_input')
CALIBRATION_RULE = call(1, FORK, S + 'scenario_calibration_rule')
LOSS_TRACKERS = call(1, FORK, S + 'scenario_loss_trackers')
LAYOUT_FROM_GROUPS = call(2, FORK, S + 'scenario_layout_from_process_groups')


def _ok(per_rank):
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'rank {rank}: {res["error"]}'
    return per_rank


@pytest.mark.parametrize('acc,finalize,expected', E2E)
def test_naive_boundary_warmup_breaks_pristine(acc, finalize, expected):
    for res in _ok(PRISTINE_E2E[acc].result()):
        assert res['step_error'] == expected


def test_pristine_has_no_warmup_module():
    for res in PRISTINE_NO_MODULE.result():
        assert res['error'] == "ModuleNotFoundError: No module named 'megatron.training.warmup'"


@pytest.mark.parametrize('ws', [1, 2])
@pytest.mark.parametrize('acc', [acc for acc, _, _ in E2E])
def test_fork_warmup_trains(ws, acc):
    for rank, res in enumerate(_ok(FORK_E2E[(ws, acc)].result())):
        assert res['step_error'] is None
        assert len(res['losses']) == 3 and all(loss == loss for loss in res['losses'])
        assert res['groups_reset'] > 0 and res['host_staging_bytes'] > 0
        # The one-time cost the warmup moved out of the real run: its first step's time minus
        # the median of its later ones (one later step here).
        first, second = res['step_seconds']
        assert res['one_time_cost'] == first - second
        if rank == 0:
            n = res['groups_reset']
            assert res['log'][0] == (
                f'[warmup] Reset DDP grad-ready calibration on {n} bucket groups '
                f'(0 outstanding collectives drained; calibration kept on {n})'
            )
            assert res['log'][1].startswith('[warmup] Ran 2 warmup train steps in ') and res['log'][
                1
            ].endswith(
                f' (first step {first:.2f}s, later ones {second:.2f}s: '
                f'{first - second:.2f}s of one-time cost moved out of the real run; '
                f'{res["compilations"]} torch.compile compilations) and restored '
                'the model, optimizer, scheduler, RNG and counters '
                f'({res["host_staging_bytes"] / 2**20:.1f} MiB staged in host memory)'
            )


@pytest.mark.parametrize('ws', [1, 2])
def test_exact_restore(ws):
    for res in _ok(EXACT[ws].result()):
        for r in res['results']:
            combo = r['combo']
            fork = r['fork']
            if combo.get('break') == 'rng':
                # Negative control: without the RNG restore the comparison sees a difference.
                assert not r['identical'] and 'rng' in r['diff_keys'], combo
                continue
            if combo.get('initial_loss_scale') == 2.0**32:
                # fp16 at upstream's default scale. The warmup without its hold (the fork before
                # it): the scaler skipped both steps, no optimizer step ran (no Adam state was
                # created). With the hold: both steps reached the optimizer (Adam counted 2 steps),
                # and the restore put the scaler and the fresh optimizer state back exactly.
                held = combo.get('break') != 'loss_scale'
                assert fork['skipped_steps'] == (0 if held else 2), combo
                assert fork['adam_steps_before_restore'] == (2.0 if held else 0.0), combo
                assert fork['fresh_state_kept'] is held, combo
                # Held at 1 for every step, though the scaler grew after the first (window 1).
                scales = fork['warmup_loss_scales']
                assert scales == ([1.0, 1.0] if held else [2.0**32] * 2), combo
            assert r['identical'], (combo, r['diff_keys'], r['losses_none'], r['losses_fork'])
            if combo.get('resume'):
                # The warmup really starts from a resumed state (what the reload must put back).
                start = fork['start']
                assert start['iteration'] == combo['resume'], combo
                assert start['scheduler_num_steps'] > 0 and start['optimizer_state'] > 0, combo
            if combo.get('dumps'):
                # Real steps dump (once each); warmup steps do not.
                first = combo.get('resume', 0) + 1
                assert r['dumps_none'] == [['params', first + i] for i in range(3)], combo
            if combo['dtype'] == 'fp16':
                # A dynamic scaler whose state the digests compare; it grew during the run.
                scalers = r['scaler_none']  # one per sub-optimizer (dense, expert)
                assert scalers and all(sc['scale'] > 4096 for sc in scalers), combo
            assert fork['train_step_restored'], combo
            # The warmup ran where train() calls it, after install_train_loop_hooks(), and handed
            # the set-up back as train() expects it for its first real step (callbacks as
            # installed, pre-hooks as that function left them).
            assert fork['train_hook_ran'], combo
            assert fork['after_warmup_equals_before'], combo
            assert fork['callbacks_restored'] and fork['hooks_restored'], combo
            assert fork['timers_restored'], combo
            if not combo.get('resume'):  # train_step created its timers during the warmup
                assert 'optimizer' in fork['timers_touched'], combo
            # The steps ran with train()'s no_sync_func: their calibration is kept (overlap).
            kept = fork['groups_reset'] if combo['overlap'] else 0
            assert fork['groups_reset'] > 0 and fork['calibration_kept'] == kept, combo
            if combo.get('break') == 'loss_scale':
                continue
            # Torch Adam's fresh state stays allocated, zeroed (None: a resumed run).
            assert fork['fresh_state_kept'] is (None if combo.get('resume') else True), combo


def test_one_time_cost_is_the_first_step_minus_the_median_of_the_later_ones():
    """WarmupReport.one_time_cost and the log line, under a fake clock (steps of 5, 1, 2, 6 s):
    5 - median(1, 2, 6) = 3 s (the mean would give 2 s); with one step there is none."""
    (res,) = _ok(ONE_TIME_COST[(5.0, 1.0, 2.0, 6.0)].result())
    assert res['step_error'] is None and res['step_seconds'] == [5.0, 1.0, 2.0, 6.0]
    assert res['one_time_cost'] == 3.0
    assert res['log'][1].startswith('[warmup] Ran 4 warmup train steps in ')
    assert (
        ' (first step 5.00s, later ones 2.00s: 3.00s of one-time cost moved out of the real '
        f'run; {res["compilations"]} torch.compile compilations) and restored '
    ) in res['log'][1]
    (res,) = _ok(ONE_TIME_COST[(5.0,)].result())
    assert res['step_error'] is None and res['step_seconds'] == [5.0]
    assert res['one_time_cost'] is None
    assert f' (first step 5.00s; {res["compilations"]} torch.compile compilations) and ' in (
        res['log'][1]
    )


def test_exception_in_warmup_restores_and_reraises():
    for res in _ok(FAULT.result()):
        assert res['raised'] == '_Injected: injected failure inside a warmup step'
        assert res['calls'] == 4  # failed in microbatch 2 of warmup step 2
        assert res['callbacks_restored'] and res['hooks_restored']
        assert res['state_restored'], res['state_diff']
        assert res['identical_to_no_warmup']


def test_failed_warmup_puts_back_the_calibration_of_earlier_steps():
    """A resumed run: its real steps calibrated DDP before the warmup. A warmup step fails, so the
    warmup's own calibration is dropped; the earlier one is put back as it was."""
    for res in _ok(FAULT_RESUMED.result()):
        assert res['raised'] == '_Injected: injected failure inside a warmup step'
        assert res['calibrated_before'] > 0
        assert res['calibration_restored']
        assert res['state_restored'], res['state_diff']
        assert res['identical_to_no_warmup']


def test_failed_restore_keeps_the_step_error_and_restores_host_state():
    for res in _ok(FAULT_RESTORE_FAILS.result()):
        assert res['raised'] == '_Injected: injected failure inside a warmup step'
        assert res['callbacks_restored'] and res['hooks_restored']
        assert res['state_restored'], res['state_diff']


def test_bad_input():
    (res,) = _ok(BAD_INPUT.result())
    flag = 'pretrain: error: argument --warmup-train-steps: --warmup-train-steps must be a'
    assert res['argparse']['2'] == {'value': 2} and res['argparse']['0'] == {'value': 0}
    for value in ('-1', '1.5', 'two'):
        assert res['argparse'][value] == {
            'exit': 2,
            'error': f"{flag} non-negative integer, got '{value}'",
        }
    assert res['defaults'] == 0 and res['config_defaults'] == 0
    errors = res['errors']
    unsupported = 'WarmupUnsupportedError: --warmup-train-steps does not support '
    layout = f'{unsupported}an inconsistent layout ('
    assert errors['pipeline'] == (
        f'{layout}pipeline_model_parallel_size: 2 in the args, 1 in the model config, 1 in the '
        'process groups)'
    )
    assert errors['pipeline_model_config'] == (
        f'{layout}pipeline_model_parallel_size: 1 in the args, 2 in the model config, 1 in the '
        'process groups)'
    )
    assert errors['virtual_pipeline'] == (
        f'{layout}virtual_pipeline_model_parallel_size: 2 in the args, 1 in the model config, 1 '
        'in the process groups)'
    )
    assert errors['virtual_pipeline_model_config'].endswith(
        ', 2 in the model config, 1 in the process groups)'
    )
    assert errors['two_chunks'] == (
        f'{unsupported}2 model chunks with virtual_pipeline_model_parallel_size=1 (one chunk per '
        'virtual pipeline stage)'
    )
    assert errors['not_ddp'].startswith(f'{unsupported}model chunks that are not Megatron DDP')
    assert errors['no_optimizer'] == (
        'WarmupUnsupportedError: --warmup-train-steps needs an optimizer (got None)'
    )
    assert errors['fp8'] == (
        'WarmupUnsupportedError: --warmup-train-steps cannot restore Transformer Engine FP8 '
        "scaling state yet (fp8='hybrid', fp8_recipe='delayed')"
    )
    assert errors['fp4'].endswith("FP4 scaling state yet (fp4='nvfp4', fp4_recipe='nvfp4')")
    assert errors['megatron_fsdp'] == f'{unsupported}--use-megatron-fsdp'
    assert errors['torch_fsdp2'] == f'{unsupported}--use-torch-fsdp2'
    for flag in (
        'optimizer-cpu-offload',
        'chunked-optimizer-state-offload',
        'offload-optimizer-states',
    ):
        key = flag.replace('-', '_')
        assert errors[f'{key}_args'] == f'{unsupported}--{flag}'
        assert errors[f'{key}_optimizer_config'] == f'{unsupported}--{flag} (optimizer config)'
    assert errors['supported'] is None
    assert (
        errors['negative']
        == 'ValueError: warmup_train_steps must be a non-negative integer, got -1'
    )
    assert (
        errors['float'] == 'ValueError: warmup_train_steps must be a non-negative integer, got 1.5'
    )
    assert not any(res['callbacks_untouched'].values())


def test_inconsistent_layout_read_from_the_process_groups():
    for res in _ok(LAYOUT_FROM_GROUPS.result()):
        assert res['args_pp'] == 1 and res['config_pp'] == 1
        assert res['error_message'] == (
            'WarmupUnsupportedError: --warmup-train-steps does not support an inconsistent layout '
            '(pipeline_model_parallel_size: 1 in the args, 1 in the model config, 2 in the process '
            'groups)'
        )


def test_warmup_calibration_is_kept_only_where_it_is_the_real_one():
    """Kept with train()'s no_sync_func and overlap; reset (backstop) otherwise. For MoE models
    the expert params whose grad a router may withhold are decided per bucket group
    (tests/test_warmup_pp.py)."""
    for res in _ok(CALIBRATION_RULE.result()):
        assert res == {
            'overlap, no_sync installed, dense': True,
            'no overlap': False,
            'overlap, no no_sync_func': False,
            'overlap, MoE': True,
        }


def test_restore_clears_every_loss_tracker():
    """The restore calls each clean-up a helper has, so no warmup loss reaches training_log: MTP's
    and the DSA indexer's, whose only clean-up is clean_loss_in_tracker where MTP's is
    clean_metrics_in_tracker (0.19.2); tests/test_warmup_observed.py sees MTP's through
    pretrain()."""
    (res,) = _ok(LOSS_TRACKERS.result())
    assert all(value > 0 for value in res['after_step'].values()), res
    assert sorted(res['after_step']) == ['dsa', 'mtp'], res
    assert res['after_clean_up'] == {name: 0.0 for name in res['after_step']}


COMPILATIONS = call(1, FORK, S + 'scenario_compilations', steps=3)


def test_the_report_counts_the_compilations_of_its_steps():
    """A forward step that runs upstream's compiled ``swiglu`` on a new row count at each call:
    the report counts what dynamo compiled during the steps (the graphs it then holds for
    ``swiglu``: a static one and a dynamic one), and the log line says so."""
    (res,) = _ok(COMPILATIONS.result())
    assert res['graphs'] == 2, res
    assert res['compilations'] == res['graphs']
    assert f'; {res["graphs"]} torch.compile compilations) and restored ' in res['log'][0]
