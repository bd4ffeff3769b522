# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import torch

from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
    process_mtp_loss,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

SEQ = 4
SCALE = 0.5


def _identity_output_layer(hidden_states, weight=None, runtime_gather_output=None):
    return hidden_states, None


def _hidden_value_as_loss(labels, logits):
    """Per-token "loss" [b, s] equal to the logit, so its gradient is the token's weight."""
    return logits[..., 0].transpose(0, 1)


def _mtp_token_weights(config, loss_mask):
    """Backward of one microbatch's MTP loss: the gradient weight of each of its positions."""
    device = torch.cuda.current_device()
    hidden = torch.zeros(2 * SEQ, 1, 1, device=device, requires_grad=True)  # [main; mtp]
    out = process_mtp_loss(
        hidden_states=hidden,
        labels=torch.zeros(1, SEQ, dtype=torch.long, device=device),
        loss_mask=loss_mask.to(device),
        output_layer=_identity_output_layer,
        output_weight=None,
        runtime_gather_output=None,
        is_training=False,
        compute_language_model_loss=_hidden_value_as_loss,
        config=config,
    )
    out.sum().backward()
    return hidden.grad[SEQ:, 0, 0].cpu()


class TestMTPPerTokenLossMicrobatchCounts:
    """With calculate_per_token_loss, finalize_model_grads divides every gradient by the main-loss
    token count of the whole step, which no microbatch knows at its backward. An MTP token must
    get the same weight in every microbatch, whatever that microbatch's own token counts."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        MTPLossLoggingHelper.tracker = {}
        Utils.destroy_model_parallel()

    def test_mtp_token_weight_is_the_same_in_every_microbatch(self):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=1,
            num_attention_heads=1,
            mtp_num_layers=1,
            mtp_loss_scaling_factor=SCALE,
            calculate_per_token_loss=True,
        )
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=torch.cuda.current_device()))
        full = torch.ones(1, SEQ)  # SEQ main tokens, SEQ - 1 MTP tokens after the roll
        short = torch.ones(1, SEQ)
        short[0, 2:] = 0  # 2 main tokens, 1 MTP token
        for loss_mask in (full, short):
            rolled = torch.roll(loss_mask, -1, -1)[0]
            rolled[-1] = 0
            # Like a main-loss token (weight 1 before finalize_model_grads), times the MTP scale.
            expected = rolled * SCALE
            got = _mtp_token_weights(config, loss_mask)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
