# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import warmup_expert_gemms
from tests.unit_tests.test_utilities import Utils

HIDDEN, FFN, EXPERTS, TOPK, SEQ, MBS = 8, 20, 4, 2, 16, 2  # 32 tokens a micro-batch
EXPERT_DIMS = {2 * FFN, FFN}  # fc1 weight [40, 8], fc2 [8, 20]: no other GEMM has these


class _MMRecorder(TorchDispatchMode):
    """Operand shapes, strides and dtypes of every aten.mm: the GEMM's configuration."""

    def __init__(self):
        super().__init__()
        self.calls = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.calls.add(tuple((tuple(a.shape), a.stride(), a.dtype) for a in args[:2]))
        return func(*args, **(kwargs or {}))


def _expert_gemms(calls):
    return {
        c
        for c in calls
        if any(d in EXPERT_DIMS for shape, _, _ in c for d in shape)
        and all(d > 0 for shape, _, _ in c for d in shape)
    }


class TestWarmupExpertGemms:
    """The GEMMs the warmup runs for SequentialMLP experts are the ones their real steps run,
    for the token counts an expert is likeliest to receive, within cuBLAS's shape cache."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(57)
        self.device = 'cuda' if torch.cuda.is_available() else 'cpu'
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            ffn_hidden_size=FFN,
            num_attention_heads=4,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_router_load_balancing_type='none',
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            gradient_accumulation_fusion=False,
        )
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
        torch.manual_seed(57)
        self.layer = build_module(spec, config=config, layer_number=1).to(self.device)
        self.config = config
        self.args = SimpleNamespace(micro_batch_size=MBS, seq_length=SEQ, context_parallel_size=1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _step(self, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(SEQ, MBS, HIDDEN, generator=gen).to(self.device).requires_grad_()
        with _MMRecorder() as rec:
            out, _ = self.layer(x, attention_mask=None)
            out.float().pow(2).sum().backward()
        return _expert_gemms(rec.calls)

    def test_plan_runs_the_expert_gemms_of_real_steps(self):
        warm = self._step(1) | self._step(2)
        with torch.no_grad():
            self.layer.mlp.router.weight.zero_()  # every token to the same two experts
        real = self._step(3)
        assert real - warm, "random batches already ran every GEMM of the concentrated step"
        params = [p.detach().clone() for p in self.layer.parameters()]
        plan = warmup_expert_gemms.plan_expert_gemms([self.layer], self.config, self.args)
        with _MMRecorder() as rec:
            assert warmup_expert_gemms.run_expert_gemms(plan) == plan.num_gemms == 2 * 3 * 32
        assert not (real | warm) - rec.calls
        assert all(torch.equal(p, q) for p, q in zip(self.layer.parameters(), params))

    def test_likeliest_counts_last_within_the_cache(self, monkeypatch):
        plan = warmup_expert_gemms.plan_expert_gemms([self.layer], self.config, self.args)
        assert (plan.max_tokens, plan.mean_tokens) == (32, 16.0)
        assert sorted(plan.token_counts) == list(range(1, 33)) and plan.token_counts[-1] == 16
        room = warmup_expert_gemms.RESERVED_ENTRIES + 2 * 3 * 5
        monkeypatch.setenv('CUBLASLT_HEURISTICS_CACHE_CAPACITY', str(room))
        plan = warmup_expert_gemms.plan_expert_gemms([self.layer], self.config, self.args)
        assert plan.token_counts == [14, 18, 15, 17, 16]

    @pytest.mark.parametrize(
        'layout, bounds',
        [
            ({}, (32, 16.0)),
            ({'expert_model_parallel_size': 2}, (64, 32.0)),
            # the router sees 16 tokens a rank, gathered over the TP x EP group
            ({'sequence_parallel': True, 'tensor_model_parallel_size': 2}, (32, 16.0)),
            ({'tensor_model_parallel_size': 2}, (64, 32.0)),
            ({'moe_expert_capacity_factor': 1.5}, (24, 16.0)),
            ({'moe_expert_capacity_factor': 1.1}, (18, 16.0)),
            (
                {'moe_expert_capacity_factor': 1.5, 'moe_pad_expert_input_to_capacity': True},
                (24, 24.0),
            ),
            (  # 17 a rank (16.32 rounded up, upstream's get_capacity) from 2 ranks
                {
                    'expert_model_parallel_size': 2,
                    'moe_expert_capacity_factor': 1.02,
                    'moe_pad_expert_input_to_capacity': True,
                },
                (34, 34.0),
            ),
        ],
    )
    def test_token_bounds(self, layout, bounds):
        config = SimpleNamespace(
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            expert_model_parallel_size=1,
            sequence_parallel=False,
            tensor_model_parallel_size=1,
            expert_tensor_parallel_size=None,
            moe_expert_capacity_factor=None,
            moe_pad_expert_input_to_capacity=False,
        )
        for name, value in layout.items():
            setattr(config, name, value)
        assert warmup_expert_gemms.expert_token_bounds(config, self.args) == bounds
