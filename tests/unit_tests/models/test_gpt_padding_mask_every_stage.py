# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

SEQ, BSZ, HIDDEN = 8, 2, 16


class TestGPTPaddingMaskEveryStage:
    """Under sequence parallelism every pipeline stage routes its own chunk of s / TP tokens, so
    the padding mask that _preprocess hands to the decoder (and to MTP) must be that chunk on
    every stage, not only on the first (pre_process) one."""

    def setup_method(self, method):
        if Utils.world_size < 2 or Utils.world_size % 2:
            pytest.skip("needs an even world size of at least 2 (TP 2)")
        Utils.initialize_model_parallel(tensor_model_parallel_size=2)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    @pytest.mark.parametrize("pre_process", [True, False])
    def test_padding_mask_is_the_stage_chunk(self, pre_process):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            use_cpu_initialization=True,
        )
        spec = get_gpt_layer_local_spec()
        # No norms: the test is about the mask, and torch's LayerNorm refuses sequence parallelism.
        spec.submodules.input_layernorm = IdentityOp
        spec.submodules.pre_mlp_layernorm = IdentityOp
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=64,
            max_sequence_length=SEQ,
            pre_process=pre_process,
            post_process=False,
            position_embedding_type="learned_absolute",
        ).cuda()
        tokens = torch.randint(0, 64, (BSZ, SEQ)).cuda()
        positions = torch.arange(SEQ).unsqueeze(0).expand(BSZ, SEQ).cuda()
        padding_mask = torch.zeros(BSZ, SEQ, dtype=torch.bool)
        padding_mask[0, SEQ - 3 :] = True
        if not pre_process:
            # A later stage: its input is the previous stage's scattered hidden states.
            model.set_input_tensor(torch.zeros(SEQ // 2, BSZ, HIDDEN).cuda())
        out = model._preprocess(
            input_ids=tokens, position_ids=positions, padding_mask=padding_mask.cuda()
        )
        rank = parallel_state.get_tensor_model_parallel_rank()
        want = padding_mask[:, rank * SEQ // 2 : (rank + 1) * SEQ // 2]
        assert torch.equal(out[5].cpu(), want), (out[5], want)
