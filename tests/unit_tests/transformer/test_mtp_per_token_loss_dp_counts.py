# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
    process_mtp_loss,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

SEQ = 4
SCALE = 0.5


def _loss_mask(dp_rank: int) -> torch.Tensor:
    """DP rank 0 keeps all SEQ tokens (SEQ - 1 after the MTP roll); the others keep two (one)."""
    mask = torch.ones(1, SEQ)
    if dp_rank > 0:
        mask[0, 2:] = 0
    return mask


def _identity_output_layer(hidden_states, weight=None, runtime_gather_output=None):
    return hidden_states, None


def _hidden_value_as_loss(labels, logits):
    """Per-token "loss" [b, s] equal to the logit, so its gradient is the token's weight."""
    return logits[..., 0].transpose(0, 1)


class TestMTPPerTokenLossDataParallelCounts:
    """With calculate_per_token_loss, finalize_model_grads divides every gradient by the token
    count summed over the DP x CP group, so an MTP token's weight must not depend on the token
    counts of the rank that holds it."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        MTPLossLoggingHelper.tracker = {}
        Utils.destroy_model_parallel()

    @pytest.mark.skipif(Utils.world_size < 2, reason="needs at least two data-parallel ranks")
    def test_mtp_token_weight_uses_data_parallel_counts(self):
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        config = TransformerConfig(
            num_layers=1,
            hidden_size=1,
            num_attention_heads=1,
            mtp_num_layers=1,
            mtp_loss_scaling_factor=SCALE,
            calculate_per_token_loss=True,
        )
        device = torch.cuda.current_device()
        hidden = torch.zeros(2 * SEQ, 1, 1, device=device, requires_grad=True)  # [main; mtp]
        labels = torch.zeros(1, SEQ, dtype=torch.long, device=device)
        loss_mask = _loss_mask(dp_rank).to(device)

        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
        out = process_mtp_loss(
            hidden_states=hidden,
            labels=labels,
            loss_mask=loss_mask,
            output_layer=_identity_output_layer,
            output_weight=None,
            runtime_gather_output=None,
            is_training=False,
            compute_language_model_loss=_hidden_value_as_loss,
            config=config,
        )
        out.sum().backward()
        mtp_grad = hidden.grad[SEQ:, 0, 0].cpu()

        # Each valid MTP token (after the roll) has one weight, and it is the same on every DP
        # rank: the token counts of one rank must not weight its tokens differently.
        valid = torch.roll(_loss_mask(dp_rank), -1, -1)[0]
        valid[-1] = 0
        weights = mtp_grad[valid > 0]
        assert torch.all(mtp_grad[valid == 0] == 0)
        assert torch.all(weights == weights[0])
        all_weights = [torch.zeros(1) for _ in range(dp_size)]
        torch.distributed.all_gather_object(all_weights, weights[:1])
        for rank, weight in enumerate(all_weights):
            assert weight.item() == weights[0].item(), (rank, weight.item(), weights[0].item())
