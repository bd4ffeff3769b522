# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import argparse
import random

import numpy as np
import pytest
import torch

from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.training import global_vars
from megatron.training.arguments import add_megatron_arguments
from megatron.training.training import build_train_valid_test_data_iterators
from tests.unit_tests.test_utilities import Utils

SAMPLES = 32


def _provider(train_valid_test_num_samples):
    """Datasets of SAMPLES samples each, built with a draw from every host stream (as a builder
    that shuffles or samples may draw)."""
    random.random(), np.random.rand(), torch.rand(1)
    dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES * 4).view(SAMPLES, 4))
    return dataset, dataset, dataset


def _set_args(iteration):
    argv = ["--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "4"]
    argv += ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1"]
    argv += ["--train-iters", "8", "--eval-iters", "1", "--eval-interval", "4"]
    argv += ["--num-workers", "0", "--dataloader-type", "single"]
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    args.rank, args.world_size, args.data_parallel_size = 0, 1, 1
    # what validate_args() would derive
    args.eval_micro_batch_size, args.eval_global_batch_size = 2, 2
    args.iteration = iteration
    args.consumed_train_samples = iteration * args.global_batch_size
    args.consumed_valid_samples = 0
    global_vars.destroy_global_vars()
    destroy_num_microbatches_calculator()
    global_vars.set_global_variables(args, build_tokenizer=False)
    return args


def _host_rng():
    return {
        "python": repr(random.getstate()),
        "numpy": repr(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
    }


def _moved(before, after):
    """The streams whose state differs between ``before`` and ``after``."""
    return [name for name in before if before[name] != after[name]]


class TestDataIteratorsHostRng:
    """A resumed run builds its data iterators without moving the host's random streams."""

    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        global_vars.destroy_global_vars()
        destroy_num_microbatches_calculator()
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("iteration", [1, 3])
    def test_resumed_run_keeps_the_restored_streams(self, iteration):
        """After a load (iteration > 0) the streams are those the checkpoint restored, and the
        iterators start at the consumed samples."""
        _set_args(iteration)
        torch.manual_seed(1234)
        random.seed(1234)
        np.random.seed(1234)
        restored = _host_rng()
        train, valid, test = build_train_valid_test_data_iterators(_provider)
        assert _moved(restored, _host_rng()) == []
        first = next(train)[0]
        assert first[0, 0].item() == 2 * iteration * 4
        assert valid is not None and test is not None

    def test_fresh_run_draws_as_before(self):
        """A fresh run (iteration 0) is left as it was: the builder's draws, then each iterator's
        base-seed draw."""
        _set_args(0)
        torch.manual_seed(1234)
        build_train_valid_test_data_iterators(_provider)
        after_build = torch.get_rng_state()
        torch.manual_seed(1234)
        torch.rand(1)
        for _ in range(3):  # the train, valid and test iterators
            torch.empty((), dtype=torch.int64).random_()
        assert torch.equal(after_build, torch.get_rng_state())
