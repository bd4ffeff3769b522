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

EXPERTS, HIDDEN, SEQ, BSZ, COEFF = 4, 8, 8, 2, 1e-2


class _Scalars:
    def __init__(self):
        self.values = {}

    def add_scalar(self, name, value, iteration):
        self.values[name] = float(value)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class TestZLossValidTokenMean:
    """With a padding mask under sequence parallelism the TP ranks hold different counts of valid
    tokens; the z-loss (its gradient under the mean loss, and the logged value) must be the mean
    over all valid tokens of the sequence, not the mean of the ranks' own means."""

    def setup_method(self, method):
        if Utils.world_size < 2 or Utils.world_size % 2:
            pytest.skip("needs an even world size of at least 2 (TP 2)")
        Utils.initialize_model_parallel(tensor_model_parallel_size=2)

    def teardown_method(self, method):
        get_moe_metrics_tracker().clear()
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    def test_z_loss_is_the_valid_token_mean(self):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            num_moe_experts=EXPERTS,
            moe_router_topk=2,
            moe_router_load_balancing_type="none",
            moe_z_loss_coeff=COEFF,
            add_bias_linear=False,
            use_cpu_initialization=True,
        )
        router = TopKRouter(
            config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        ).cuda()
        router.set_layer_number(1)
        weight = torch.randn(router.weight.shape, generator=_gen(0), dtype=torch.float64)
        with torch.no_grad():
            router.weight.copy_(weight)
        x = torch.randn(SEQ, BSZ, HIDDEN, generator=_gen(1), dtype=torch.float64)
        # Padding at the end of sequence 0: the second TP chunk holds 3 of 8 tokens padded.
        padding = torch.zeros(SEQ, BSZ, dtype=torch.bool)
        padding[SEQ - 3 :, 0] = True
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        chunk = slice(tp_rank * SEQ // 2, (tp_rank + 1) * SEQ // 2)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1).cuda())
        get_moe_metrics_tracker().clear()
        probs, _ = router(x[chunk].float().cuda(), padding_mask=padding[chunk].cuda())
        (probs * 0).sum().backward()
        grad = router.weight.grad.detach().double().cpu()
        torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        writer = _Scalars()
        get_moe_metrics_tracker().report(loss_scale=1.0, iteration=1, writer=writer, num_layers=1)

        ref_weight = weight.clone().requires_grad_(True)
        logits = x.reshape(-1, HIDDEN) @ ref_weight.t()
        valid = ~padding.reshape(-1)
        z = torch.logsumexp(logits, dim=-1).square()[valid].mean()
        (z * COEFF).backward()
        assert writer.values["z_loss"] == pytest.approx(float(z), rel=1e-5)
        torch.testing.assert_close(grad, ref_weight.grad, rtol=1e-5, atol=1e-7)
