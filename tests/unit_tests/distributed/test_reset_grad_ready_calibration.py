# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import copy

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class DenseAndExpertModel(torch.nn.Module):
    """A dense linear layer followed by an expert-parallel one (allreduce=False)."""

    def __init__(self, hidden_size: int = 8):
        super().__init__()
        self.dense = torch.nn.Linear(hidden_size, hidden_size)
        self.expert = torch.nn.Linear(hidden_size, hidden_size)
        for param in self.expert.parameters():
            param.allreduce = False

    def forward(self, x):
        return self.expert(torch.relu(self.dense(x)))


def _wrap(module: torch.nn.Module) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=False
    )
    config = TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=8)
    return DistributedDataParallel(config, ddp_config=ddp_config, module=module)


def _run_batch(model, microbatches, use_no_sync: bool):
    """Forward/backward over the microbatches, as the no-pipelining schedule does."""
    model.zero_grad_buffer()
    for index, x in enumerate(microbatches):
        last = index == len(microbatches) - 1
        if use_no_sync and not last:
            with model.no_sync():
                model(x).square().sum().backward()
        else:
            model(x).square().sum().backward()
    model.finish_grad_sync()


def _reference_grads(module, microbatches):
    grads = {name: torch.zeros_like(param) for name, param in module.named_parameters()}
    for x in microbatches:
        module.zero_grad()
        module(x).square().sum().backward()
        for name, param in module.named_parameters():
            grads[name] += param.grad
    return grads


class TestResetGradReadyCalibration:
    """DistributedDataParallel.reset_grad_ready_calibration() re-arms the first-batch calibration.

    With overlap_grad_reduce=True each bucket group records, in the first batch, how often each
    param registers its grad as ready; later batches dispatch the reduce when the counts match.
    A first batch run with a different microbatch structure (e.g. a warm-up step without
    no_sync) leaves a wrong calibration that breaks every later step.
    """

    def setup_method(self, method):
        Utils.initialize_model_parallel()
        torch.manual_seed(1234)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _microbatches(self, num_microbatches=2):
        return [torch.randn(3, 8).cuda() for _ in range(num_microbatches)]

    def test_mismatched_first_batch_breaks_later_steps(self):
        """The failure the reset exists for: a first batch without no_sync, later ones with."""
        model = _wrap(DenseAndExpertModel().cuda())
        _run_batch(model, self._microbatches(), use_no_sync=False)
        with pytest.raises(AssertionError, match="Communication call has not been issued"):
            _run_batch(model, self._microbatches(), use_no_sync=True)

    def test_reset_recalibrates_and_grads_match(self):
        """After the reset, steps with no_sync run and reduce the accumulated grads."""
        module = DenseAndExpertModel().cuda()
        reference = copy.deepcopy(module)
        model = _wrap(module)
        num_groups = len(model.bucket_groups) + len(model.expert_parallel_bucket_groups)
        assert len(model.bucket_groups) >= 1 and len(model.expert_parallel_bucket_groups) >= 1

        _run_batch(model, self._microbatches(), use_no_sync=False)  # "warm-up" calibration
        model.zero_grad_buffer()
        assert model.reset_grad_ready_calibration() == (num_groups, 0)
        for group in model.bucket_groups + model.expert_parallel_bucket_groups:
            assert group.is_first_batch
            assert group.golden_per_param_grad_ready_counts == {}

        for _ in range(3):
            microbatches = self._microbatches()
            _run_batch(model, microbatches, use_no_sync=True)
            expected = _reference_grads(reference, microbatches)
            for name, param in model.module.named_parameters():
                torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-5, atol=1e-6)
        for group in model.bucket_groups + model.expert_parallel_bucket_groups:
            assert not group.is_first_batch
            assert set(group.golden_per_param_grad_ready_counts.values()) == {1}

    def test_reset_drains_an_outstanding_grad_reduce(self):
        """A reduce left in flight (no finish_grad_sync) is awaited and cleared by the reset."""
        model = _wrap(DenseAndExpertModel().cuda())
        _run_batch(model, self._microbatches(), use_no_sync=True)  # calibration: 1 per param
        model.zero_grad_buffer()
        for x in self._microbatches(1):  # all params ready -> reduce dispatched, never finished
            model(x).square().sum().backward()
        groups = model.bucket_groups + model.expert_parallel_bucket_groups
        in_flight = sum(group.grad_reduce_handle is not None for group in groups)
        assert in_flight == len(groups)

        assert model.reset_grad_ready_calibration() == (len(groups), in_flight)
        assert all(group.grad_reduce_handle is None for group in groups)
        model.zero_grad_buffer()
        _run_batch(model, self._microbatches(), use_no_sync=True)
        _run_batch(model, self._microbatches(), use_no_sync=True)

    def test_reset_keeping_golden_counts_overlaps_the_next_batch(self):
        """keep_golden_counts=True drains a reduce in flight but keeps the calibration, so the
        next batch dispatches its reduce during backward, as every later batch does."""
        model = _wrap(DenseAndExpertModel().cuda())
        _run_batch(model, self._microbatches(), use_no_sync=True)  # calibration: 1 per param
        model.zero_grad_buffer()  # takes the first batch's counts as golden
        groups = model.bucket_groups + model.expert_parallel_bucket_groups
        golden = [dict(group.golden_per_param_grad_ready_counts) for group in groups]
        assert all(counts for counts in golden)
        for x in self._microbatches(1):  # all params ready -> reduce dispatched, never finished
            model(x).square().sum().backward()

        drained = [group.reset_grad_ready_calibration(keep_golden_counts=True) for group in groups]
        assert drained == [1] * len(groups)
        for group, counts in zip(groups, golden):
            assert not group.is_first_batch and group.golden_per_param_grad_ready_counts == counts
            assert group.grad_reduce_handle is None and group.per_param_grad_ready_counts == {}
        model.zero_grad_buffer()
        for x in self._microbatches(1):
            model(x).square().sum().backward()
        assert all(group.grad_reduce_handle is not None for group in groups)
        model.finish_grad_sync()

    def test_reset_options_pick_the_bucket_groups(self):
        """recalibrate_params resets the groups holding one of them although keep_golden_counts
        keeps the others; keep_bucket_groups keeps its groups in a full reset."""
        model = _wrap(DenseAndExpertModel().cuda())
        _run_batch(model, self._microbatches(), use_no_sync=True)
        model.zero_grad_buffer()  # calibrated: the dense group and the expert group
        dense, expert = model.bucket_groups + model.expert_parallel_bucket_groups
        assert not dense.is_first_batch and not expert.is_first_batch

        routed = [model.module.expert.weight]
        assert model.reset_grad_ready_calibration(True, recalibrate_params=routed) == (2, 0)
        assert not dense.is_first_batch and expert.is_first_batch

        assert model.reset_grad_ready_calibration(keep_bucket_groups=[dense]) == (2, 0)
        assert not dense.is_first_batch and dense.golden_per_param_grad_ready_counts
        assert expert.is_first_batch and expert.golden_per_param_grad_ready_counts == {}
