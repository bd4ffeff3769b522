# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

EXPERTS, HIDDEN, SEQ, BSZ = 4, 8, 8, 2


class _Scalars:
    def __init__(self):
        self.values = {}

    def add_scalar(self, name, value, iteration):
        self.values[name] = float(value)


class TestZLossMetricTPAverage:
    """Under sequence parallelism each TP rank's router computes the z-loss of its own sequence
    chunk; the logged z-loss must be that of the whole sequence on every rank, not the chunk's."""

    def setup_method(self, method):
        if Utils.world_size < 2 or Utils.world_size % 2:
            pytest.skip("needs an even world size of at least 2 (TP 2)")
        Utils.initialize_model_parallel(tensor_model_parallel_size=2)

    def teardown_method(self, method):
        get_moe_metrics_tracker().clear()
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    def test_logged_z_loss_is_the_sequence_mean(self):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            num_moe_experts=EXPERTS,
            moe_router_topk=2,
            moe_router_load_balancing_type="none",
            moe_z_loss_coeff=1e-2,
            add_bias_linear=False,
            use_cpu_initialization=True,
        )
        router = TopKRouter(
            config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        ).cuda()
        router.set_layer_number(1)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=_gen(0)))
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # Chunks with different scales, so that their z-losses differ.
        x = torch.randn(SEQ, BSZ, HIDDEN, generator=_gen(1), dtype=torch.float64)
        x *= torch.linspace(0.5, 3.0, SEQ, dtype=torch.float64).view(SEQ, 1, 1)
        chunk = x[tp_rank * SEQ // 2 : (tp_rank + 1) * SEQ // 2]
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1).cuda())
        get_moe_metrics_tracker().clear()
        router(chunk.float().cuda())

        writer = _Scalars()
        get_moe_metrics_tracker().report(loss_scale=1.0, iteration=1, writer=writer, num_layers=1)

        logits = x.reshape(-1, HIDDEN) @ router.weight.detach().cpu().double().t()
        want = float(torch.logsumexp(logits, dim=-1).square().mean())
        assert writer.values["z_loss"] == pytest.approx(want, rel=1e-5)


def _gen(seed):
    return torch.Generator().manual_seed(seed)
