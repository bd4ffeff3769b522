# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import math

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from tests.unit_tests.test_utilities import Utils


class TestGradNormEmptyGrads:
    """A rank whose grads are all filtered out (frozen, shared, TP duplicates) passes an empty
    list; every norm type must give 0 there and still join the reduction."""

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("norm_type", [math.inf, 1.0, 2.0, 3.0])
    def test_empty_list_gives_zero(self, norm_type):
        Utils.initialize_model_parallel()
        norm = get_grad_norm_fp32(
            [],
            norm_type=norm_type,
            grad_stats_parallel_group=parallel_state.get_model_parallel_group(),
        )
        assert float(norm) == 0.0

    @pytest.mark.parametrize("norm_type", [math.inf, 1.0, 3.0])
    def test_only_rank_zero_has_grads(self, norm_type):
        """Ranks > 0 pass an empty list; the reduced norm is rank 0's."""
        Utils.initialize_model_parallel()
        values = torch.tensor([1.0, -2.0, 0.5]).cuda()
        grads = [values] if torch.distributed.get_rank() == 0 else []
        norm = get_grad_norm_fp32(
            grads, norm_type=norm_type, grad_stats_parallel_group=torch.distributed.group.WORLD
        )
        expected = float(torch.linalg.vector_norm(values.double(), ord=norm_type))
        assert float(norm) == pytest.approx(expected, rel=1e-6)
