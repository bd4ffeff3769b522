# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.test_utilities import Utils


def _rank_group(rank: int):
    """Stands in for the dense TP group in the duplicate filter, which only asks for the rank."""
    return SimpleNamespace(rank=lambda: rank)


class DenseAndExpertParams(torch.nn.Module):
    """A replicated dense param and an expert param (allreduce=False), neither TP-split."""

    def __init__(self, dense_numel: int, expert_numel: int):
        super().__init__()
        self.dense = torch.nn.Parameter(torch.ones(dense_numel))
        self.expert = torch.nn.Parameter(torch.ones(expert_numel))
        self.expert.allreduce = False

    def forward(self, x):
        return x * self.dense.sum() + x * self.expert.sum()


def _ddp_and_optimizer(use_distributed_optimizer: bool, dense_numel: int, expert_numel: int):
    module = DenseAndExpertParams(dense_numel, expert_numel).bfloat16().cuda()
    config = TransformerConfig(
        num_attention_heads=1, num_layers=1, hidden_size=8, bf16=True, params_dtype=torch.bfloat16
    )
    model = DistributedDataParallel(
        config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
        ),
        module=module,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=0.0,
            bf16=True,
            clip_grad=1.0e6,
            log_num_zeros_in_grad=True,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [model],
    )
    return model, optimizer


def _grad_stats(model, optimizer, grad_value: float):
    """(grad norm, zero count) that optimizer.step() reports for main grads all ``grad_value``."""
    for param in model.parameters():
        param.main_grad.fill_(grad_value)
    update_successful, grad_norm, num_zeros = optimizer.step()
    assert update_successful
    return float(grad_norm), int(num_zeros)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["bf16", "distopt"])
class TestExpertGradStatsUseExpertTensorParallelGroup:
    """Grad norm and zero count must deduplicate expert params over the expert TP group.

    Expert params (allreduce=False) are replicated over the expert TP group, not the dense one.
    Filtering them with the dense TP rank drops the experts of dense TP ranks > 0 (ETP < TP), so
    the reported norm (and the clipping that uses it) misses those experts.
    """

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_expert_params_survive_on_dense_tp_rank_one(self, use_distributed_optimizer):
        """World 1, simulating dense TP rank 1 with ETP = 1 (a stub dense TP group).

        On such a rank the dense param is a TP duplicate, but the expert param is this rank's
        own and must be counted: norm sqrt(expert_numel), zero count expert_numel.
        """
        Utils.initialize_model_parallel()
        model, optimizer = _ddp_and_optimizer(use_distributed_optimizer, 4, 3)
        for child in optimizer.chained_optimizers:
            child.tp_group = _rank_group(1)

        grad_norm, _ = _grad_stats(model, optimizer, 1.0)
        assert grad_norm == pytest.approx(math.sqrt(3), rel=1e-6)
        _, num_zeros = _grad_stats(model, optimizer, 0.0)
        assert num_zeros == 3

    def test_tp_equals_ep_equals_world_with_etp_one(self, use_distributed_optimizer):
        """Multi-rank oracle: one dense and one distinct expert scalar per rank, grads 1."""
        world = Utils.world_size
        if world < 2:
            pytest.skip("needs world size >= 2 (TP = EP = world, ETP = 1)")
        Utils.initialize_model_parallel(
            tensor_model_parallel_size=world,
            expert_model_parallel_size=world,
            expert_tensor_parallel_size=1,
        )
        model, optimizer = _ddp_and_optimizer(use_distributed_optimizer, 1, 1)
        grad_norm, _ = _grad_stats(model, optimizer, 1.0)
        assert grad_norm == pytest.approx(math.sqrt(1 + world), rel=1e-6)
        _, num_zeros = _grad_stats(model, optimizer, 0.0)
        assert num_zeros == 1 + world
