# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


def _config(tp, ep):
    """ETP = 1; linear layers have biases (the default)."""
    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=8,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
        num_moe_experts=4,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        use_cpu_initialization=True,
    )


def _row_parallel_bias(config, is_expert):
    tp_group = (
        parallel_state.get_expert_tensor_parallel_group()
        if is_expert
        else parallel_state.get_tensor_model_parallel_group()
    )
    layer = RowParallelLinear(
        8,
        8,
        config=config,
        init_method=config.init_method,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
        is_expert=is_expert,
        tp_group=tp_group,
    )
    return layer.bias


class TestExpertBiasGradReduction:
    """The fc2 (RowParallelLinear) bias of an expert is reduced over its expert-DP replicas only.

    DDP reduces it in the expert buffers. It must not also be marked sequence_parallel, or
    finalize_model_grads sums it over the dense TP group, which holds other experts (EP > 1)
    or the same expert-DP replicas again (EP = 1, ETP != TP).
    """

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2)], ids=["tp2-ep1-etp1", "tp2-ep2-etp1"])
    def test_expert_bias_is_not_sequence_parallel(self, tp, ep):
        """World 1 is enough: the marks depend on the config sizes."""
        Utils.initialize_model_parallel()
        config = _config(tp, ep)
        expert_bias = _row_parallel_bias(config, is_expert=True)
        assert expert_bias.allreduce is False
        assert expert_bias.sequence_parallel is False
        dense_bias = _row_parallel_bias(config, is_expert=False)
        assert dense_bias.allreduce is True
        assert dense_bias.sequence_parallel is True

    @pytest.mark.parametrize("ep_is_world", [True, False], ids=["ep-world", "ep1"])
    def test_finalize_model_grads_reduces_expert_bias_over_expert_dp(self, ep_is_world):
        """TP = world, ETP = 1, real MoE layer: each rank writes 2**rank into every grad."""
        world = Utils.world_size
        if world < 2 or world % 2 != 0:
            pytest.skip("needs an even world size >= 2 (TP = world, ETP = 1)")
        ep = world if ep_is_world else 1
        Utils.initialize_model_parallel(
            tensor_model_parallel_size=world,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
        config = _config(world, ep)
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        model = DistributedDataParallel(
            config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=spec.submodules.mlp(config=config).cuda(),
        )
        for param in model.parameters():
            param.main_grad.fill_(float(2 ** torch.distributed.get_rank()))
        finalize_model_grads([model])

        # Dense DP is 1, so DDP does not scale; expert DP is 1 (EP = world) or world (EP = 1).
        expert_dp = torch.distributed.get_process_group_ranks(
            parallel_state.get_expert_data_parallel_group()
        )
        expected_expert = float(sum(2**rank for rank in expert_dp))
        expected_dense = float(2**world - 1)  # router: summed over the TP group (all ranks)
        for name, param in model.module.named_parameters():
            expected = expected_expert if "experts" in name else expected_dense
            torch.testing.assert_close(
                param.main_grad,
                torch.full_like(param.main_grad, expected),
                msg=lambda m, name=name: f"{name}: {m}",
            )
