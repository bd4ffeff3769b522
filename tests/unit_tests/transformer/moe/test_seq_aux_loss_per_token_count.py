# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

SEQ, BSZ, HIDDEN = 6, 3, 8


def _router_weight_grad(per_token, padded):
    """The router weight's grad from seq_aux_loss alone; under per-token loss divided by the
    micro-batch's valid tokens, as finalize_model_grads does (TP = DP = 1)."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_router_load_balancing_type='seq_aux_loss',
        moe_aux_loss_coeff=0.1,
        calculate_per_token_loss=per_token,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    router = TopKRouter(
        config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    ).cuda()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    x = torch.randn(SEQ, BSZ, HIDDEN, generator=gen).cuda()
    mask = torch.zeros(SEQ, BSZ, dtype=torch.bool)
    if padded:
        mask[SEQ - 2 :, 0] = True  # 2 padding tokens in sequence 0, 1 in sequence 2
        mask[0, 2] = True
    kwargs = {'padding_mask': mask.cuda()} if padded else {}
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1).cuda())
    probs, _ = router(x, **kwargs)
    (probs * 0).sum().backward()
    grad = router.weight.grad.detach().clone()
    return grad / (~mask).sum().item() if per_token else grad


class TestSeqAuxLossPerTokenCount:
    """Under per-token loss the sequence-level aux loss was pre-multiplied by total_num_tokens,
    which counts one sequence (the batch is folded into the expert dimension): its gradient was
    1 / micro-batch-size of the mean-loss one (with padding, floor(valid / bsz) / valid)."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    @pytest.mark.parametrize("padded", [False, True])
    def test_per_token_matches_mean_loss(self, padded):
        mean = _router_weight_grad(per_token=False, padded=padded)
        per_token = _router_weight_grad(per_token=True, padded=padded)
        assert mean.abs().max() > 0
        torch.testing.assert_close(per_token, mean, rtol=1e-5, atol=1e-7)
