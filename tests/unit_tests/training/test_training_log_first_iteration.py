# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import argparse
import re

import pytest
import torch

from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.training import global_vars
from megatron.training.arguments import add_megatron_arguments
from megatron.training.training import training_log
from tests.unit_tests.test_utilities import Utils

LOSSES = [4.0, 2.0, 1.0, 3.0]


def _args(log_interval):
    argv = ["--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length", "8"]
    argv += ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1"]
    argv += ["--ffn-hidden-size", "32", "--kv-channels", "8", "--num-query-groups", "1"]
    argv += ["--log-interval", str(log_interval), "--train-iters", str(len(LOSSES))]
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    args.rank, args.world_size, args.data_parallel_size = 0, 1, 1
    args.padded_vocab_size, args.consumed_train_samples = 16, 0
    args.skipped_train_samples = 0
    return args


def _logged_losses(capsys, log_interval, first_iteration=1):
    """Run training_log as train() does and return {iteration: printed lm loss}."""
    global_vars.destroy_global_vars()
    destroy_num_microbatches_calculator()
    global_vars.set_global_variables(_args(log_interval), build_tokenizer=False)
    global_vars.get_timers()('interval-time', log_level=0).start(barrier=True)
    total_loss_dict, printed = {}, {}
    for i, loss in enumerate(LOSSES):
        iteration = first_iteration + i
        training_log(
            {'lm loss': torch.tensor([loss], device='cuda')},
            total_loss_dict,
            1e-3,
            iteration,
            1.0,
            False,
            0,
            1.0,
            None,
            None,
            None,
            is_first_iteration=(i == 0),
        )
        found = re.findall(r"lm loss: (\S+) \|", capsys.readouterr().out)
        if found:
            printed[iteration] = float(found[-1])
    global_vars.destroy_global_vars()
    destroy_num_microbatches_calculator()
    return printed


class TestTrainingLogFirstIteration:
    """The first logged iteration is counted once, whatever the log interval."""

    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_log_interval_one_prints_each_iterations_own_loss(self, capsys):
        assert _logged_losses(capsys, 1) == dict(zip(range(1, 5), LOSSES))

    def test_resumed_run_on_a_boundary_prints_each_iterations_own_loss(self, capsys):
        assert _logged_losses(capsys, 1, first_iteration=51) == dict(zip(range(51, 55), LOSSES))

    @pytest.mark.parametrize("first_iteration", [1, 3])
    def test_first_iteration_between_boundaries_stays_in_the_interval(
        self, capsys, first_iteration
    ):
        # Interval 2: the first line reports the first iteration alone; the next line at a
        # boundary still averages the whole interval it closes, the first iteration included.
        printed = _logged_losses(capsys, 2, first_iteration=first_iteration)
        assert printed == {
            first_iteration: LOSSES[0],
            first_iteration + 1: (LOSSES[0] + LOSSES[1]) / 2,
            first_iteration + 3: (LOSSES[2] + LOSSES[3]) / 2,
        }
