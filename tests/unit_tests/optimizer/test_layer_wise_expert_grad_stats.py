# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups,
    get_standard_config_overrides,
)
from megatron.core.optimizer.layer_wise_optimizer import (
    LayerWiseDistributedOptimizer,
    tag_params_for_buffer_routing,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.test_utilities import Utils


def _rank_group(rank: int):
    """Stands in for the dense TP group in the duplicate filter, which only asks for the rank."""
    return SimpleNamespace(rank=lambda: rank)


class DenseAndExpertMatrices(torch.nn.Module):
    """One dense [1, 1] matrix, one expert bias-like matrix and one expert weight-like matrix.

    The expert matrices are allreduce=False; the weight-like one is marked tensor-parallel, as
    expert linear weights are (with ETP = 1 it is a whole tensor).
    """

    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Parameter(torch.zeros(1, 1, dtype=torch.bfloat16))
        self.expert_bias = torch.nn.Parameter(torch.zeros(1, 1, dtype=torch.bfloat16))
        self.expert_weight = torch.nn.Parameter(torch.zeros(1, 1, dtype=torch.bfloat16))
        self.expert_bias.allreduce = False
        self.expert_weight.allreduce = False
        set_tensor_model_parallel_attributes(self.expert_weight, True, 0, 1)


def _layer_wise_optimizer(full_param_layout: bool):
    """DDP-wrap the matrices and build LayerWiseDistributedOptimizer as the factory does.

    Adam stands in for Muon (which needs the emerging-optimizers package); the statistics do
    not depend on the update rule.
    """
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16
    )
    module = DenseAndExpertMatrices().cuda()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=full_param_layout
    )
    kwargs = {}
    if full_param_layout:
        tag_params_for_buffer_routing([module])
        kwargs["full_param_layout"] = LayerWiseDistributedOptimizer.compute_full_param_layout(
            list(module.parameters()),
            ddp_config.bucket_size,
            parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            ddp_config,
            expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size(),
        )
    model = DistributedDataParallel(config, ddp_config, module, **kwargs)
    # The statistics are read directly (no step): neither clipping nor logging flags matter.
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=0.0, bf16=True, use_layer_wise_distributed_optimizer=True
    )
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    param_groups = _get_param_groups(
        [model], optimizer_config, get_standard_config_overrides(optimizer_config)
    )
    base, init_state_fn = _get_megatron_optimizer_based_on_param_groups(
        config=optimizer_config,
        model_chunks=[model],
        param_groups=param_groups,
        model_parallel_group=pg_collection.mp,
        pg_collection=pg_collection,
        skip_megatron_wrapping=True,
    )
    optimizer = LayerWiseDistributedOptimizer(
        [base],
        optimizer_config,
        pg_collection,
        init_state_fn_list=[init_state_fn],
        model_chunks=[model],
    )
    return model, optimizer


def _grad_stats(model, optimizer, grad_value: float):
    """(grad norm, zero count) of main grads that are all ``grad_value``."""
    for param in model.module.parameters():
        param.main_grad.fill_(grad_value)
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm()), int(optimizer.count_zeros())


@pytest.mark.parametrize("full_param_layout", [False, True], ids=["legacy", "layout"])
class TestLayerWiseOptimizerExpertGradStats:
    """LayerWiseDistributedOptimizer must deduplicate expert params over the expert TP group.

    Its children are wrapped inside the layer-wise optimizer and never got the TP groups, and its
    count_zeros passed none, so every param was filtered with the dense TP rank. With dense DP of
    one rank it also kept a full copy of the experts on every expert-DP rank.
    """

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_expert_params_survive_on_dense_tp_rank_one(self, full_param_layout):
        """World 1, simulating dense TP rank 1 with ETP = 1 (a stub dense TP group).

        The dense matrix is a TP duplicate there; the two expert matrices are this rank's own.
        """
        Utils.initialize_model_parallel()
        model, optimizer = _layer_wise_optimizer(full_param_layout)
        for target in (optimizer, *optimizer.chained_optimizers):
            target.tp_group = _rank_group(1)

        grad_norm, _ = _grad_stats(model, optimizer, 1.0)
        assert grad_norm == pytest.approx(math.sqrt(2), rel=1e-6)
        _, num_zeros = _grad_stats(model, optimizer, 0.0)
        assert num_zeros == 2

    @pytest.mark.parametrize(("tp", "ep"), [(2, 2), (2, 1)], ids=["tp2-ep2-etp1", "tp2-ep1-etp1"])
    def test_exact_oracle_with_tp_two_and_etp_one(self, full_param_layout, tp, ep):
        """Multi-rank: norm sqrt(1 + 2 EP) and zero count 1 + 2 EP on every rank.

        On 2 ranks, TP2/EP1/ETP1 has dense DP 1 and expert DP 2: the experts must be sharded
        over expert DP instead of being counted once per expert-DP replica.
        """
        if Utils.world_size < 2 or Utils.world_size % 2 != 0:
            pytest.skip("needs an even world size >= 2 (TP 2 with ETP 1)")
        Utils.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
        model, optimizer = _layer_wise_optimizer(full_param_layout)
        grad_norm, _ = _grad_stats(model, optimizer, 1.0)
        assert grad_norm == pytest.approx(math.sqrt(1 + 2 * ep), rel=1e-6)
        _, num_zeros = _grad_stats(model, optimizer, 0.0)
        assert num_zeros == 1 + 2 * ep
