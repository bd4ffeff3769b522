# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import (
    _allreduce_non_tensor_model_parallel_grads,
)
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class _Replicated(torch.nn.Module):
    """Two replicated weights; ``partial`` is marked as holding a per-TP-rank partial grad."""

    def __init__(self):
        super().__init__()
        self.partial = torch.nn.Parameter(torch.ones(4))
        self.plain = torch.nn.Parameter(torch.ones(4))
        setattr(self.partial, "sum_gradients_across_tp_domain", True)


def _main_grads(sequence_parallel):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel,
    )
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(), module=_Replicated().cuda()
    )
    rank = parallel_state.get_tensor_model_parallel_rank()
    for param in (model.module.partial, model.module.plain):
        param.main_grad.copy_(torch.arange(4.0).cuda() + 10 * rank)
    _allreduce_non_tensor_model_parallel_grads([model], config)
    return model.module.partial.main_grad.cpu(), model.module.plain.main_grad.cpu(), rank


class TestSumGradientsAcrossTpDomain:
    """A replicated parameter whose grads are per-TP-rank partial sums (GatedDeltaNet's out_norm:
    each rank normalizes its own heads) is summed over TP by finalize_model_grads, once, with or
    without sequence parallelism; other replicated parameters are left alone."""

    def setup_method(self, method):
        if Utils.world_size < 2 or Utils.world_size % 2:
            pytest.skip("needs an even world size of at least 2 (TP 2)")
        Utils.initialize_model_parallel(tensor_model_parallel_size=2)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("sequence_parallel", [False, True])
    def test_marked_grads_are_summed_over_tp(self, sequence_parallel):
        partial, plain, rank = _main_grads(sequence_parallel)
        assert torch.equal(partial, 2 * torch.arange(4.0) + 10)  # rank 0's + rank 1's
        assert torch.equal(plain, torch.arange(4.0) + 10 * rank)
