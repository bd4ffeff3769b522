# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.training.utils import common_utils
from tests.unit_tests.test_utilities import Utils


def _rank_group(rank: int):
    """Stands in for the dense TP group in the duplicate filter, which only asks for the rank."""
    return SimpleNamespace(rank=lambda: rank)


def _dense_and_expert(dense_numel: int, expert_numel: int):
    """A replicated dense param and an expert param (allreduce=False), neither TP-split."""
    model = torch.nn.ParameterDict(
        {"dense": torch.ones(dense_numel), "expert": torch.ones(expert_numel)}
    )
    model.expert.allreduce = False
    return model.cuda()


@pytest.fixture
def fp32_args(monkeypatch):
    """calc_params_l2_norm reads two flags from the global args."""
    monkeypatch.setattr(
        common_utils, "get_args", lambda: SimpleNamespace(use_megatron_fsdp=False, bf16=False)
    )


class TestParamNormExpertTensorParallelGroup:
    """calc_params_l2_norm must deduplicate expert params over the expert TP group."""

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_expert_param_counted_on_dense_tp_rank_one(self, fp32_args, monkeypatch):
        """World 1, simulating dense TP rank 1 with ETP = 1.

        The dense TP rank is stubbed to 1 in both places it can be read from (the global
        rank and the TP group); the expert TP group is the real one (rank 0). The dense param is
        a TP duplicate there, the expert param is this rank's own: norm sqrt(expert_numel).
        """
        Utils.initialize_model_parallel()
        monkeypatch.setattr(tp_layers, "get_tensor_model_parallel_rank", lambda: 1)
        monkeypatch.setattr(
            parallel_state, "get_tensor_model_parallel_group", lambda *a, **k: _rank_group(1)
        )
        model = _dense_and_expert(4, 3)
        assert common_utils.calc_params_l2_norm([model]) == pytest.approx(math.sqrt(3))

    def test_all_params_counted_on_tp_rank_zero(self, fp32_args):
        """World 1 without stubs: every param counts (unchanged behaviour)."""
        Utils.initialize_model_parallel()
        model = _dense_and_expert(4, 3)
        assert common_utils.calc_params_l2_norm([model]) == pytest.approx(math.sqrt(7))

    @pytest.mark.skipif(Utils.world_size < 2, reason="needs TP = EP = world size >= 2, ETP = 1")
    def test_tp_equals_ep_equals_world_with_etp_one(self, fp32_args):
        """Multi-rank oracle: one dense and one distinct expert scalar per rank, all ones."""
        world = Utils.world_size
        Utils.initialize_model_parallel(
            world, expert_model_parallel_size=world, expert_tensor_parallel_size=1
        )
        model = _dense_and_expert(1, 1)
        assert common_utils.calc_params_l2_norm([model]) == pytest.approx(math.sqrt(1 + world))
