# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import argparse

import pytest
import torch

from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import global_vars
from megatron.training.arguments import add_megatron_arguments
from megatron.training.training import evaluate
from tests.unit_tests.test_utilities import Utils

# (loss sum, valid tokens) of each microbatch, two microbatches per evaluation iteration: the
# counts differ, one microbatch has no valid token at all.
MICROBATCHES = [(10.0, 10), (8.0, 2), (3.0, 6), (0.0, 0)]


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        self.pg_collection = None  # evaluate() then reduces over megatron's own groups
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, input_tensor):
        pass


def _forward_step(data_iterator, model):
    loss, tokens = next(data_iterator)

    def loss_func(output_tensor):
        loss_sum = output_tensor.new_tensor(loss)
        num_tokens = torch.tensor(tokens, dtype=torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.cat([loss_sum.view(1), num_tokens.view(1)])}

    return torch.zeros(1), loss_func


def _set_args(sft):
    argv = ["--micro-batch-size", "1", "--global-batch-size", "2", "--seq-length", "4"]
    argv += ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1"]
    argv += ["--train-iters", "4", "--eval-iters", "2", "--eval-interval", "4"]
    argv += ["--sft"] if sft else []
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    args.rank, args.world_size, args.data_parallel_size = 0, 1, 1
    # what validate_args() would derive
    args.eval_micro_batch_size, args.eval_global_batch_size = 1, 2
    args.consumed_valid_samples = 0
    global_vars.destroy_global_vars()
    destroy_num_microbatches_calculator()
    global_vars.set_global_variables(args, build_tokenizer=False)
    return args


class TestEvaluateTokenWeightedLoss:
    """evaluate() returns the loss over every evaluated token, whatever the microbatches hold."""

    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        global_vars.destroy_global_vars()
        destroy_num_microbatches_calculator()
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("sft", [False, True])
    def test_eval_loss_is_the_mean_over_evaluated_tokens(self, sft):
        _set_args(sft)
        model = [_Model()]
        totals, _, timelimit = evaluate(
            _forward_step, iter(MICROBATCHES), model, None, model[0].config
        )
        assert not timelimit
        expected = sum(loss for loss, _ in MICROBATCHES) / sum(n for _, n in MICROBATCHES)
        # 21 / 18; the mean over the iterations of the mean per microbatch would be 1.375
        assert totals["lm loss"].item() == pytest.approx(expected, rel=1e-6)
