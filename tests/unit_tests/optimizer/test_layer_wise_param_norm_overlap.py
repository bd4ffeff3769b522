# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups,
    get_standard_config_overrides,
)
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.training.utils import common_utils
from tests.unit_tests.test_utilities import Utils

ROWS = (3, 2, 4, 1)
LR = 0.5


def _initial(index: int):
    start = 2 * sum(ROWS[:index])
    return [1.0 + (start + j) / 4.0 for j in range(2 * ROWS[index])]


class Matrices(torch.nn.Module):
    """[rows, 2] bf16 matrices with values 1 + i / 4 (exact in bf16)."""

    def __init__(self):
        super().__init__()
        for index, rows in enumerate(ROWS):
            value = torch.tensor(_initial(index), dtype=torch.bfloat16).reshape(rows, 2)
            setattr(self, f"w{index}", torch.nn.Parameter(value.cuda()))


def _layer_wise_optimizer_with_overlapped_gather():
    """DDP with overlapped param gather and a LayerWise (SGD) optimizer, as the factory builds."""
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    model = DistributedDataParallel(config, ddp_config, Matrices())
    optimizer_config = OptimizerConfig(
        optimizer="sgd",
        lr=LR,
        min_lr=LR,
        weight_decay=0.0,
        sgd_momentum=0.0,
        bf16=True,
        clip_grad=0.0,
        use_layer_wise_distributed_optimizer=True,
        overlap_param_gather=True,
    )
    param_groups = _get_param_groups(
        [model], optimizer_config, get_standard_config_overrides(optimizer_config)
    )
    # The raw SGD (no Megatron wrapping): LayerWise shards the params and wraps it for bf16.
    base, init_state_fn = _get_megatron_optimizer_based_on_param_groups(
        optimizer_config, [model], param_groups, skip_megatron_wrapping=True
    )
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    optimizer = LayerWiseDistributedOptimizer(
        [base], optimizer_config, pg_collection, [init_state_fn], model_chunks=[model]
    )
    return model, optimizer


class TestLayerWiseParamNormWithOverlappedGather:
    """With overlap_param_gather the updated params reach non-owner ranks only at the next
    forward, so the logged param norm must come from the owners' main params."""

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.skipif(Utils.world_size < 2, reason="needs at least two data-parallel ranks")
    def test_param_norm_right_after_the_step(self, monkeypatch):
        Utils.initialize_model_parallel(1, 1)
        monkeypatch.setattr(
            common_utils, "get_args", lambda: SimpleNamespace(use_megatron_fsdp=False, bf16=True)
        )
        model, optimizer = _layer_wise_optimizer_with_overlapped_gather()
        for param in model.module.parameters():
            param.main_grad.fill_(1.0)
        optimizer.step()

        # The gather has not run: some params on this rank still hold their old value.
        stale = sum(
            int(
                (
                    getattr(model.module, f"w{i}").float().reshape(-1).cpu()
                    == torch.tensor(_initial(i))
                ).sum()
            )
            for i in range(len(ROWS))
        )
        assert stale > 0
        expected = math.sqrt(sum((v - LR) ** 2 for i in range(len(ROWS)) for v in _initial(i)))
        assert common_utils.calc_params_l2_norm([model]) == pytest.approx(expected, rel=1e-6)


def test_qk_clip_skips_an_absent_main_param():
    """A sharded param has main_param None on the ranks that do not own it."""
    weight = torch.nn.Parameter(torch.ones(4, 2))
    weight.main_param = None
    attention = SimpleNamespace(
        config=SimpleNamespace(qk_clip=True, qk_clip_threshold=1.0),
        core_attention=SimpleNamespace(current_max_attn_logits=torch.tensor([4.0, 4.0])),
        num_attention_heads_per_partition=2,
        num_query_groups_per_partition=2,
        linear_qkv=SimpleNamespace(weight=weight),
        _clip_linear_qkv=lambda w: w * 0.5,
    )
    SelfAttention.clip_qk(attention)
    assert torch.equal(weight.detach(), torch.full((4, 2), 0.5))
