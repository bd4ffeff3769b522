# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

from contextlib import nullcontext

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard import (
    MixedPrecisionPolicy,
    fully_shard_model,
)
from tests.unit_tests.test_utilities import Utils

HIDDEN = 16
BATCH = 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b0 = Block()
        self.b1 = Block()

    def forward(self, x):
        return self.b1(self.b0(x))


def _microbatch(index, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1000 * torch.distributed.get_rank() + index)
    return torch.randn(BATCH, HIDDEN, generator=generator).to(dtype=dtype)


def _reference_grads(num_microbatches):
    """Per-rank sum of the microbatch gradients, accumulated in float64."""
    torch.manual_seed(1234)
    model = ToyModel().double()
    for index in range(num_microbatches):
        model(_microbatch(index, torch.float64)).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


class TestSingleRankGradAccumulation:
    """
    A gradient buffer whose DP-Shard group has one rank is not sharded: the microbatch gradients
    accumulate in it, so it must be reduced (scaled) once per optimization cycle. Reducing it
    after every backward pass rescales the accumulated gradients once per microbatch, and with a
    custom gradient communication dtype adds the reduced copy of the buffer to the buffer.
    """

    def setup_method(self, method):
        Utils.initialize_distributed()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _accumulate(
        self, num_microbatches, grad_comm_dtype=None, scaling_factor=None, div_fusion=None
    ):
        from torch.distributed.device_mesh import init_device_mesh

        # DP-Shard (and TP) of one rank on every rank; the ranks train independently.
        world_size = torch.distributed.get_world_size()
        device_mesh = init_device_mesh(
            "cuda", (world_size, 1, 1), mesh_dim_names=("replica", "dp_shard", "tp")
        )
        torch.manual_seed(1234)
        model = fully_shard_model(
            ToyModel().cuda(),
            device_mesh=device_mesh,
            dp_shard_dim="dp_shard",
            tp_dim="tp",
            fsdp_unit_modules=[Block],
            zero_dp_strategy="optim_grads_params",
            mixed_precision_policy=MixedPrecisionPolicy(
                main_params_dtype=torch.float32,
                main_grads_dtype=torch.float32,
                grad_comm_dtype=grad_comm_dtype,
            ),
            sync_model_each_microbatch=False,
        )
        if div_fusion is not None:
            model.ddp_config.gradient_reduce_div_fusion = div_fusion
        buffer = model.param_and_grad_buffer
        for group in buffer.parameter_groups:
            assert group.main_grad_buffer.data_parallel_group.size() == 1
            assert not group.main_grad_buffer.is_data_distributed
            if scaling_factor is not None:
                # As for an expert buffer whose expert-DP group is narrower than the DP
                # domain that sets its 1 / dp scale (EP = DP).
                group.main_grad_buffer.gradient_scaling_factor = scaling_factor
        model.zero_grad_buffer()
        for index in range(num_microbatches):
            last = index == num_microbatches - 1
            with nullcontext() if last else model.no_sync():
                model(_microbatch(index).cuda()).sum().backward()
        model.finish_grad_sync()

        grads = {}
        for group in buffer.parameter_groups:
            gbuf = group.main_grad_buffer
            for param in group.params:
                item = gbuf.get_item(gbuf.param_idx[param], only_shard=False)
                name = buffer.param_to_name[param].removeprefix("module.")
                grads[name] = item.double().cpu().reshape(param.shape)
        return grads

    @pytest.mark.parametrize("num_microbatches", [1, 3, 4])
    def test_custom_grad_comm_dtype_reduces_once(self, num_microbatches):
        grads = self._accumulate(num_microbatches, grad_comm_dtype=torch.bfloat16)
        for name, expected in _reference_grads(num_microbatches).items():
            # One bf16 rounding of the accumulated gradients (the communication buffer).
            torch.testing.assert_close(
                grads[name], expected, rtol=1e-2, atol=1e-2, msg=lambda m, n=name: f"{n}: {m}"
            )

    @pytest.mark.parametrize("div_fusion", [True, False])
    @pytest.mark.parametrize("num_microbatches", [1, 3, 4])
    def test_scaling_factor_applied_once(self, num_microbatches, div_fusion):
        grads = self._accumulate(num_microbatches, scaling_factor=0.5, div_fusion=div_fusion)
        for name, expected in _reference_grads(num_microbatches).items():
            torch.testing.assert_close(
                grads[name], 0.5 * expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )

    @pytest.mark.parametrize("num_microbatches", [3])
    def test_default_dtypes_unchanged(self, num_microbatches):
        grads = self._accumulate(num_microbatches)
        for name, expected in _reference_grads(num_microbatches).items():
            torch.testing.assert_close(
                grads[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
