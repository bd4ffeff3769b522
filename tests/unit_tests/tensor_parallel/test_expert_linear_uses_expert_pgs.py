# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


def _config(tp, etp, **kwargs):
    """EP = 1 (the default)."""
    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        expert_tensor_parallel_size=etp,
        use_cpu_initialization=True,
        perform_initialization=False,
        **kwargs,
    )


def _expert_layers(config, is_expert=True):
    tp_group = (
        parallel_state.get_expert_tensor_parallel_group()
        if is_expert
        else parallel_state.get_tensor_model_parallel_group()
    )
    common = dict(
        config=config, init_method=config.init_method, is_expert=is_expert, tp_group=tp_group
    )
    row = RowParallelLinear(8, 8, bias=True, input_is_parallel=True, skip_bias_add=False, **common)
    return torch.nn.Sequential(ColumnParallelLinear(8, 8, **common), row)


class TestExpertLinearUsesExpertProcessGroups:
    """With EP = 1 and ETP != TP, expert params belong to the expert process groups.

    Their replicas form the expert data-parallel group, not the dense one, so they must be
    marked allreduce=False: DDP then reduces them over expert DP (in the expert buffers) and
    the grad statistics deduplicate them over expert TP.
    """

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize(
        ("tp", "etp", "expected_allreduce"),
        [(2, 1, False), (1, 2, False), (1, 1, True)],
        ids=["tp2-etp1", "tp1-etp2", "tp1-etp1"],
    )
    def test_allreduce_attribute_follows_expert_topology(self, tp, etp, expected_allreduce):
        """EP = 1: the attribute depends on whether ETP differs from TP (config sizes)."""
        Utils.initialize_model_parallel()
        layers = _expert_layers(_config(tp, etp))
        for name, param in layers.named_parameters():
            assert param.allreduce is expected_allreduce, name

    def test_dense_layers_are_unaffected(self):
        """Non-expert layers stay allreduce=True whatever the expert topology."""
        Utils.initialize_model_parallel()
        layers = _expert_layers(_config(2, 1), is_expert=False)
        assert all(param.allreduce is True for param in layers.parameters())

    @pytest.mark.parametrize(("tp", "etp"), [(2, 1), (1, 2)], ids=["tp2-etp1", "tp1-etp2"])
    def test_expert_grads_are_reduced_over_expert_data_parallel(self, tp, etp):
        """Multi-rank: DDP sums expert grads over the expert DP group, not the dense DP group."""
        if Utils.world_size < 2 or Utils.world_size % 2 != 0:
            pytest.skip("needs an even world size >= 2 (TP or ETP of 2 on separate ranks)")
        Utils.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=etp,
        )
        # Per-token loss keeps DDP's pre-reduction scaling at 1, so grads are plain sums.
        config = _config(tp, etp, calculate_per_token_loss=True)
        model = DistributedDataParallel(
            config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False
            ),
            module=_expert_layers(config).cuda(),
        )
        expert_dp = torch.distributed.get_process_group_ranks(
            parallel_state.get_expert_data_parallel_group()
        )
        dense_dp = torch.distributed.get_process_group_ranks(
            parallel_state.get_data_parallel_group()
        )
        assert expert_dp != dense_dp
        for param in model.parameters():
            param.main_grad.fill_(float(2 ** torch.distributed.get_rank()))
        model.finish_grad_sync()
        expected = float(sum(2**rank for rank in expert_dp))
        for param in model.parameters():
            torch.testing.assert_close(
                param.main_grad, torch.full_like(param.main_grad, expected), rtol=0, atol=0
            )
