# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import copy
from functools import partial

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from tests.unit_tests.test_utilities import Utils


class TinyModel(MegatronModule):
    """Two linear layers, the second one expert-parallel (allreduce=False)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.dense = torch.nn.Linear(8, 8)
        self.expert = torch.nn.Linear(8, 4)
        for param in self.expert.parameters():
            param.allreduce = False

    def set_input_tensor(self, input_tensor):
        pass

    def forward(self, x):
        return self.expert(torch.tanh(self.dense(x)))


def _loss_func(output):
    loss = output.square().mean()
    return loss, {'loss': loss.detach()}


def _forward_step(data_iterator, model):
    return model(next(data_iterator)), _loss_func


class TestVariableNumMicrobatches:
    """overlap_grad_reduce without no_sync_func and a different num_microbatches per step.

    Every microbatch's backward then registers its grads as ready, so the grad-ready counts
    calibrated in the first step encode its microbatch count. Upstream, a later step with fewer
    microbatches fails in finish_grad_sync ("Communication call has not been issued for this
    bucket"), and one with more dispatches the grad reduce before its last microbatch. The
    schedule now announces num_microbatches to DDP, which recalibrates when it changes.
    """

    def setup_method(self, method):
        Utils.initialize_model_parallel()
        torch.manual_seed(1234)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _build(self):
        config = TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=8)
        module = TinyModel(config).cuda()
        reference = copy.deepcopy(module)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=False
        )
        model = DistributedDataParallel(config, ddp_config=ddp_config, module=module)
        config.no_sync_func = None  # every microbatch's backward outside no_sync
        config.finalize_model_grads_func = None
        return model, reference

    def _step(self, model, num_microbatches):
        """One step as train_step runs it; returns whether each bucket group dispatched its
        grad reduce during backward (the overlap) and the microbatches."""
        microbatches = [torch.randn(3, 8).cuda() for _ in range(num_microbatches)]
        model.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=num_microbatches,
            seq_length=1,
            micro_batch_size=3,
            forward_only=False,
        )
        groups = model.bucket_groups + model.expert_parallel_bucket_groups
        overlapped = [group.grad_reduce_handle is not None for group in groups]
        model.finish_grad_sync()
        return overlapped, microbatches

    @staticmethod
    def _check_grads(model, reference, microbatches):
        reference.zero_grad()
        for x in microbatches:
            (reference(x).square().mean() / len(microbatches)).backward()
        for param, ref in zip(model.module.parameters(), reference.parameters()):
            torch.testing.assert_close(param.main_grad, ref.grad, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize('counts', [[4, 4, 2, 2, 6, 6], [1, 3, 3, 1]])
    def test_changing_num_microbatches(self, counts):
        model, reference = self._build()
        previous = None
        for num_microbatches in counts:
            overlapped, microbatches = self._step(model, num_microbatches)
            self._check_grads(model, reference, microbatches)
            # Overlap whenever the count equals the previous step's; recalibration otherwise.
            assert all(overlapped) == (num_microbatches == previous), (counts, num_microbatches)
            assert not any(overlapped) or num_microbatches == previous
            previous = num_microbatches

    def test_call_after_dispatched_reduce_raises(self):
        """A second forward_backward call for the same step, after a first call that completed
        the calibrated step and dispatched its reduce, would add grads the reduce misses."""
        model, _ = self._build()
        self._step(model, 2)
        self._step(model, 2)
        model.zero_grad_buffer()
        for num_microbatches in (2, 1):
            run = partial(
                get_forward_backward_func(),
                forward_step_func=_forward_step,
                data_iterator=iter([torch.randn(3, 8).cuda() for _ in range(num_microbatches)]),
                model=[model],
                num_microbatches=num_microbatches,
                seq_length=1,
                micro_batch_size=3,
                forward_only=False,
            )
            if num_microbatches == 2:
                run()
            else:
                with pytest.raises(RuntimeError, match="grad reduce was already dispatched"):
                    run()
