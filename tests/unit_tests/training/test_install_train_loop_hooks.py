# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import argparse

import pytest
import torch

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.training.arguments import add_megatron_arguments
from megatron.training.training import install_train_loop_hooks
from tests.unit_tests.test_utilities import Utils

HIDDEN = 8


def _setup(argv):
    """A DDP model, its optimizer and Megatron's argument defaults plus ``argv``."""
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1))
    config = TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=HIDDEN)
    model = DistributedDataParallel(
        config,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            use_distributed_optimizer=args.use_distributed_optimizer,
            align_param_gather=args.align_param_gather,
        ),
        module=module.cuda(),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, use_distributed_optimizer=args.use_distributed_optimizer
        ),
        [model],
    )
    return model, optimizer, args


class TestInstallTrainLoopHooks:
    """install_train_loop_hooks() sets up what train()'s loop needs, and only that."""

    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_overlap_grad_reduce_callbacks(self):
        """With overlapped grad reduction: no_sync, start_grad_sync, finalize and the scaler."""
        model, optimizer, args = _setup(["--overlap-grad-reduce"])
        config = model.config
        assert install_train_loop_hooks([model], optimizer, config, args) is None
        assert config.no_sync_func == model.no_sync
        assert config.grad_sync_func == model.start_grad_sync
        assert config.finalize_model_grads_func is finalize_model_grads
        assert config.grad_scale_func == optimizer.scale_loss
        assert config.param_sync_func is None

    def test_without_overlap_only_finalize_and_scaler(self):
        """Without overlap nothing defers the reduction; a builder's finalize hook is kept."""
        model, optimizer, args = _setup([])
        config = model.config

        def custom_finalize(*args, **kwargs):
            pass

        config.finalize_model_grads_func = custom_finalize
        install_train_loop_hooks([model], optimizer, config, args)
        assert config.no_sync_func is None and config.grad_sync_func is None
        assert config.finalize_model_grads_func is custom_finalize
        assert config.grad_scale_func == optimizer.scale_loss

    def test_distributed_optimizer_param_gather_disables_pre_hooks_for_the_first_step(self):
        """Overlapped param gather: the pre-hooks are off and param_sync_func is handed back."""
        argv = ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather"]
        model, optimizer, args = _setup(argv)
        config = model.config
        assert model.remove_forward_pre_hook_handles
        param_sync_func = install_train_loop_hooks([model], optimizer, config, args)
        assert param_sync_func == model.start_param_sync
        assert config.param_sync_func is None
        assert not model.remove_forward_pre_hook_handles

    def test_a_custom_no_sync_func_is_refused_with_overlap(self):
        """A no_sync_func set before train() contradicts overlapped grad reduction."""
        model, optimizer, args = _setup(["--overlap-grad-reduce"])
        model.config.no_sync_func = lambda: None
        with pytest.raises(AssertionError, match="no_sync_func must be None"):
            install_train_loop_hooks([model], optimizer, model.config, args)
