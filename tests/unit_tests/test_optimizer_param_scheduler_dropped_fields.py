# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

from unittest.mock import MagicMock

import pytest

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _scheduler(optimizer, override):
    return OptimizerParamScheduler(
        optimizer=optimizer,
        init_lr=0.0,
        max_lr=0.1,
        min_lr=0.01,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style='linear',
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style='linear',
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=override,
    )


def _checkpoint():
    return {
        'max_lr': 0.1,
        'min_lr': 0.01,
        'lr_warmup_steps': 0,
        'lr_decay_steps': 100,
        'lr_decay_style': 'linear',
        'num_steps': 50,
        'start_wd': 0.0,
        'end_wd': 0.1,
        'wd_incr_steps': 100,
        'wd_incr_style': 'linear',
    }


@pytest.mark.parametrize('override', [True, False])
def test_override_drops_checkpointed_fields_the_run_does_not_set(override):
    """The saving run had a per-module weight-decay override on the second group; the resumed run
    dropped it. In override mode the group follows the scheduler's weight decay, as in a fresh
    run; without it the checkpoint's per-group fields stay, as before."""
    optimizer = MagicMock()
    optimizer.param_groups = [
        {'lr': 0.0, 'weight_decay': 0.0, 'max_lr': 0.1, 'min_lr': 0.01},
        {'lr': 0.0, 'weight_decay': 0.0, 'max_lr': 0.1, 'min_lr': 0.01},
    ]
    scheduler = _scheduler(optimizer, override)
    # What the optimizer load brings in from the checkpoint.
    optimizer.param_groups[1].update({'start_wd': 0.2, 'end_wd': 0.4})

    scheduler.load_state_dict(_checkpoint())

    first, second = optimizer.param_groups
    assert first['weight_decay'] == pytest.approx(0.05)
    if override:
        assert 'start_wd' not in second and 'end_wd' not in second
        assert second['weight_decay'] == pytest.approx(0.05)
    else:
        assert (second['start_wd'], second['end_wd']) == (0.2, 0.4)
        assert second['weight_decay'] == pytest.approx(0.3)
    assert (second['max_lr'], second['min_lr']) == (0.1, 0.01)
