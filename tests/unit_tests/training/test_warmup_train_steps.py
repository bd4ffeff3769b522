# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import argparse
import copy
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.training.arguments import add_megatron_arguments
from megatron.training.training import install_train_loop_hooks
from megatron.training.warmup import WarmupUnsupportedError, run_warmup
from tests.unit_tests.test_utilities import Utils

NUM_MICROBATCHES = 2
MICRO_BATCH_SIZE = 3
HIDDEN = 8


class TinyModel(torch.nn.Module):
    """Two linear layers with the attributes the no-pipelining schedule reads."""

    def __init__(self):
        super().__init__()
        self.model_type = ModelType.encoder_or_decoder
        self.fc1 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)

    def set_input_tensor(self, input_tensor):
        pass

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield {"x": torch.randn(MICRO_BATCH_SIZE, HIDDEN, generator=generator)}


def _forward_step(data_iterator, model):
    output = model(next(data_iterator)["x"].cuda())

    def loss_func(output_tensor):
        loss = output_tensor.square().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    opt_param_scheduler,
    config,
    forward_backward_func,
    iteration=0,
):
    """A minimal train_step(): zero grads, forward/backward over the microbatches, step."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=NUM_MICROBATCHES,
        seq_length=1,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=False,
    )
    update_successful, _, _ = optimizer.step()
    assert update_successful
    return sum(float(item["loss"]) for item in losses), 0


def _args(use_distributed_optimizer: bool):
    """Megatron's own argument defaults with overlapped grad reduction."""
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    argv = ["--overlap-grad-reduce"]
    if use_distributed_optimizer:
        argv.append("--use-distributed-optimizer")
    args = parser.parse_args(argv)
    args.iteration = 0
    return args


def _build(use_distributed_optimizer: bool):
    torch.manual_seed(42)
    module = TinyModel().cuda()
    config = TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=HIDDEN)
    model = DistributedDataParallel(
        config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=use_distributed_optimizer,
            bucket_size=HIDDEN * HIDDEN + HIDDEN,
        ),
        module=module,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.1,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [model],
    )
    return model, optimizer


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distopt"])
class TestRunWarmup:
    """run_warmup() runs synthetic training steps and undoes all of their effects.

    The steps run with what train() installs before its loop (install_train_loop_hooks()); without
    no_sync_func and finalize_model_grads_func, overlapped grad reduction calibrates the grad-ready
    counts for another microbatch structure and the first real step fails. run_warmup() restores
    the state and resets the calibration.
    """

    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_warmup_then_training_equals_training_alone(self, use_distributed_optimizer):
        """Two warmup steps, then three real steps: bitwise the run without a warmup."""
        args = _args(use_distributed_optimizer)
        model, optimizer = _build(use_distributed_optimizer)
        reference_model, reference_optimizer = _build(use_distributed_optimizer)
        before = copy.deepcopy(model.module.state_dict())
        forward_backward_func = get_forward_backward_func()

        # As train(): its set-up, then the warmup under it, then the real steps.
        param_sync_func = install_train_loop_hooks([model], optimizer, model.config, args)
        callbacks = (model.config.no_sync_func, model.config.finalize_model_grads_func)
        report = run_warmup(
            _train_step,
            _forward_step,
            [model],
            optimizer,
            None,
            model.config,
            param_sync_func,
            2,
            data_iterator=_batches(seed=7),
            args=args,
        )
        assert report.num_steps == 2 and len(report.losses) == 2
        num_groups = len(model.bucket_groups) + len(model.expert_parallel_bucket_groups)
        assert report.bucket_groups_reset == num_groups > 0
        for name, value in model.module.state_dict().items():
            assert torch.equal(value, before[name]), name
        # The set-up is handed back as installed, for the first real step.
        assert (model.config.no_sync_func, model.config.finalize_model_grads_func) == callbacks

        install_train_loop_hooks(
            [reference_model], reference_optimizer, reference_model.config, args
        )
        for run_model, run_optimizer in (
            (model, optimizer),
            (reference_model, reference_optimizer),
        ):
            data = _batches(seed=11)
            run_model.losses = [
                _train_step(
                    _forward_step,
                    data,
                    [run_model],
                    run_optimizer,
                    None,
                    run_model.config,
                    forward_backward_func,
                )[0]
                for _ in range(3)
            ]
        assert model.losses == reference_model.losses
        for param, reference in zip(model.module.parameters(), reference_model.module.parameters()):
            assert torch.equal(param, reference)


def test_unsupported_combinations_fail_before_any_step():
    """A layout on which args and model config disagree, and a missing optimizer, are rejected
    with errors that name them."""
    args = SimpleNamespace(pipeline_model_parallel_size=1)
    config = SimpleNamespace(pipeline_model_parallel_size=2)
    with pytest.raises(WarmupUnsupportedError, match="inconsistent layout"):
        run_warmup(None, None, [torch.nn.Linear(2, 2)], object(), None, config, None, 1, args=args)
    config = SimpleNamespace(pipeline_model_parallel_size=1)
    with pytest.raises(WarmupUnsupportedError, match="needs an optimizer"):
        run_warmup(None, None, [torch.nn.Linear(2, 2)], None, None, config, None, 1, args=args)


def test_zero_steps_is_a_no_op_and_negative_steps_are_rejected():
    """num_steps=0 does nothing; a negative count is a ValueError."""
    model = [torch.nn.Linear(2, 2)]
    report = run_warmup(None, None, model, None, None, None, None, 0, args=SimpleNamespace())
    assert report.num_steps == 0 and report.losses == []
    with pytest.raises(ValueError, match="non-negative"):
        run_warmup(None, None, model, None, None, None, None, -1, args=SimpleNamespace())


def test_warmup_argument():
    """--warmup-train-steps takes a non-negative integer and defaults to 0."""
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    assert parser.parse_args([]).warmup_train_steps == 0
    assert parser.parse_args(["--warmup-train-steps", "2"]).warmup_train_steps == 2
    for bad in ("-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--warmup-train-steps", bad])
