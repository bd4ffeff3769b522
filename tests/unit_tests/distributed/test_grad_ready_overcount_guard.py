# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import copy

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.test_utilities import Utils


def _wrap(module: torch.nn.Module) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=False
    )
    config = TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=8)
    return DistributedDataParallel(config, ddp_config=ddp_config, module=module)


def _backward(model, x):
    model(x).square().sum().backward()


class TestGradReadyOvercountGuard:
    """register_grad_ready() must not dispatch a grad reduce while accumulation is still running.

    If the calibration (first) batch counted one grad-ready registration per param (no_sync
    installed) and a later batch registers every microbatch, the counts equal the calibration
    after the first microbatch: the reduce is dispatched early and the later microbatches'
    grads miss it, silently. The guard raises instead.
    """

    def setup_method(self, method):
        Utils.initialize_model_parallel()
        torch.manual_seed(1234)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _calibrate_with_no_sync(self, model, num_microbatches=2):
        model.zero_grad_buffer()
        for index in range(num_microbatches):
            x = torch.randn(3, 8).cuda()
            if index < num_microbatches - 1:
                with model.no_sync():
                    _backward(model, x)
            else:
                _backward(model, x)
        model.finish_grad_sync()
        model.zero_grad_buffer()

    def test_overcount_after_calibration_raises(self):
        """A batch without no_sync after a no_sync calibration fails at the 2nd microbatch."""
        model = _wrap(torch.nn.Linear(8, 8).cuda())
        self._calibrate_with_no_sync(model)

        _backward(model, torch.randn(3, 8).cuda())  # counts == calibration: reduce dispatched
        assert all(group.grad_reduce_handle is not None for group in model.bucket_groups)
        with pytest.raises(RuntimeError, match="Grad-ready calibration mismatch"):
            _backward(model, torch.randn(3, 8).cuda())

    def test_matching_batches_are_unaffected(self):
        """Batches with the calibrated structure reduce exactly the accumulated grads."""
        module = torch.nn.Linear(8, 8).cuda()
        reference = copy.deepcopy(module)
        model = _wrap(module)
        self._calibrate_with_no_sync(model)
        for _ in range(2):
            microbatches = [torch.randn(3, 8).cuda() for _ in range(3)]
            model.zero_grad_buffer()
            reference.zero_grad()
            for index, x in enumerate(microbatches):
                if index < len(microbatches) - 1:
                    with model.no_sync():
                        _backward(model, x)
                else:
                    _backward(model, x)
                _backward(reference, x)
            model.finish_grad_sync()
            for param, ref in zip(model.module.parameters(), reference.parameters()):
                torch.testing.assert_close(param.main_grad, ref.grad, rtol=1e-5, atol=1e-6)
