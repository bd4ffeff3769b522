# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class _RankGroup:
    """Stands in for a process group in the duplicate filter, which only asks for the rank."""

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def _attention(softmax_type: str) -> DotProductAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        softmax_type=softmax_type,
        use_cpu_initialization=True,
    )
    return DotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )


class TestSoftmaxOffsetTensorParallelAttributes:
    """The learnable softmax_offset (attention sinks) holds one value per local head.

    It is split over tensor parallelism like the heads (its sharded_state_dict shards dim 0), so
    it must be marked tensor-parallel; otherwise the grad norm, the zero count and the param norm
    count it on TP rank 0 only.
    """

    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_learnable_offset_is_marked_tensor_parallel(self):
        """The parameter carries the TP attributes of a dim-0 split."""
        offset = _attention("learnable").softmax_offset
        assert isinstance(offset, torch.nn.Parameter)
        assert offset.shape == (4,)
        assert getattr(offset, "tensor_model_parallel", False) is True
        assert offset.partition_dim == 0
        assert offset.partition_stride == 1

    def test_learnable_offset_is_counted_on_every_tp_rank(self):
        """Statistics keep each TP rank's heads: the filter must not drop them on rank > 0."""
        offset = _attention("learnable").softmax_offset
        for rank in range(4):
            assert param_is_not_tensor_parallel_duplicate(offset, tp_group=_RankGroup(rank))

    @pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one"])
    def test_other_softmax_types_have_no_offset_parameter(self, softmax_type):
        """Only the learnable offset is a parameter; the others are unchanged."""
        attention = _attention(softmax_type)
        assert "softmax_offset" not in dict(attention.named_parameters())
