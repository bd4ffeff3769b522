# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

TP = 2
SEQ = 8


def _padding_mask(device):
    """[b, s] with the padding edge exactly at the TP chunk boundary s / TP, once after the
    valid tokens (right padding) and once before them (left padding)."""
    mask = torch.zeros(2, SEQ, dtype=torch.bool, device=device)
    mask[0, SEQ // TP :] = True
    mask[1, : SEQ // TP] = True
    return mask


def _rolled_padding_mask(sequence_parallel, padding_mask):
    """The padding mask that the MTP layer hands its transformer layer (MoE router)."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=4,
        num_attention_heads=TP,
        mtp_num_layers=1,
        tensor_model_parallel_size=TP,
        sequence_parallel=sequence_parallel,
    )
    layer = MultiTokenPredictionLayer.__new__(MultiTokenPredictionLayer)
    torch.nn.Module.__init__(layer)
    layer.config = config
    layer.cp_group = parallel_state.get_context_parallel_group()
    layer.tp_group = parallel_state.get_tensor_model_parallel_group()
    b, s = padding_mask.shape
    device = padding_mask.device
    input_ids = torch.arange(b * SEQ, device=device).view(b, SEQ)
    position_ids = torch.arange(SEQ, device=device).expand(b, SEQ)
    hidden_states = torch.zeros(s, b, config.hidden_size, device=device, requires_grad=True)

    def embedding(input_ids, position_ids):
        return torch.zeros(s, b, config.hidden_size, device=device)

    _, _, rolled, _, _ = layer._get_embeddings(
        input_ids=input_ids,
        position_ids=position_ids,
        embedding=embedding,
        hidden_states=hidden_states.clone(),
        padding_mask=padding_mask,
    )
    return rolled


class TestMTPPaddingMaskSequenceParallel:
    """With sequence parallelism GPTModel scatters the padding mask to this TP rank's sequence
    chunk before the MTP block sees it. MTP's one-token roll must still shift along the whole
    sequence: the last position of a chunk takes the first position of the next chunk."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(tensor_model_parallel_size=TP)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.skipif(Utils.world_size != TP, reason=f"needs {TP} ranks")
    def test_rolled_chunk_equals_chunk_of_rolled_sequence(self):
        device = torch.cuda.current_device()
        full = _padding_mask(device)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        chunk = SEQ // TP
        expected = _rolled_padding_mask(False, full)[:, tp_rank * chunk : (tp_rank + 1) * chunk]
        local = full[:, tp_rank * chunk : (tp_rank + 1) * chunk].contiguous()
        got = _rolled_padding_mask(True, local)
        assert got.tolist() == expected.tolist()
