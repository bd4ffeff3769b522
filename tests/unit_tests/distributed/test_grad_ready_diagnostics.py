# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class ModelWithBranch(torch.nn.Module):
    """Trunk and expert layers that are always used and a branch that forward() may skip.

    With expert_branch=True the branch and the expert layer are expert-parallel
    (allreduce=False), so the unused params sit in an expert bucket group with a used one.
    """

    def __init__(self, expert_branch: bool = False):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 8)
        self.expert = torch.nn.Linear(8, 8, bias=False)
        self.branch = torch.nn.Linear(8, 8)
        self.use_branch = True
        if expert_branch:
            for param in (*self.expert.parameters(), *self.branch.parameters()):
                param.allreduce = False

    def forward(self, x):
        x = self.expert(self.trunk(x))
        if self.use_branch:
            x = self.branch(x)
        return x


def _wrap(module: torch.nn.Module) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=False
    )
    config = TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=8)
    return DistributedDataParallel(config, ddp_config=ddp_config, module=module)


def _step(model):
    model.zero_grad_buffer()
    model(torch.randn(3, 8).cuda()).square().sum().backward()
    model.finish_grad_sync()


class TestGradReadyDiagnostics:
    """With overlap_grad_reduce, a param that gets no grad must be named in the error."""

    def setup_method(self, method):
        Utils.initialize_model_parallel()
        torch.manual_seed(1234)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("expert_branch", [False, True], ids=["dense", "expert"])
    def test_param_unused_from_the_first_batch_is_named(self, expert_branch):
        """Calibration fails at the next zero_grad_buffer(); the message names the params."""
        module = ModelWithBranch(expert_branch=expert_branch).cuda()
        module.use_branch = False
        model = _wrap(module)
        _step(model)
        with pytest.raises(AssertionError) as error:
            model.zero_grad_buffer()
        message = str(error.value)
        assert "branch.weight" in message and "branch.bias" in message, message
        assert "trunk." not in message and "expert." not in message, message

    def test_param_skipped_after_the_first_batch_is_named(self):
        """finish_grad_sync() keeps upstream's first sentence and adds the missing params."""
        module = ModelWithBranch().cuda()
        model = _wrap(module)
        _step(model)
        _step(model)
        module.use_branch = False
        with pytest.raises(AssertionError) as error:
            _step(model)
        message = str(error.value)
        assert "Communication call has not been issued for this bucket" in message, message
        assert "branch.weight" in message and "branch.bias" in message, message
        assert "trunk." not in message and "expert." not in message, message
