# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import inspect

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounter

from megatron.core import jit
from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu, routed_token_fuser
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.identity_op import IdentityFuncOp

# Per-expert token counts of successive steps, as SequentialMLP splits them: every count >= 2
# first, then an expert with one token, one with none, and the probs slice of the second expert
# starting at offset 0 or 1.
STEPS = [[5, 4, 3, 6], [7, 2, 5, 3], [1, 4, 5, 2], [2, 0, 4, 6], [0, 3, 4, 1], [5, 4, 3, 6]]


def _graphs(name):
    return len(_debug_get_cache_entry_list(inspect.unwrap(getattr(fused_bias_swiglu, name))))


@pytest.mark.skipif(jit.jit_fuser is not torch.compile, reason="jit_fuser is not torch.compile")
class TestWeightedSwiGLURecompiles:
    """The experts' weighted SwiGLU runs on the tokens routed to each expert, a count that changes
    with the data. torch.compile used to compile a static graph first, a dynamic one on the
    second count, and own graphs for counts and probs offsets of 0 and 1, so MoE runs kept
    recompiling mid-run until the recompile limit sent the rest to eager. The graphs of the
    first step now serve every later count; forward calls under SMALL_ELEMENTS run eagerly."""

    def setup_method(self, method):
        torch._dynamo.reset()

    def teardown_method(self, method):
        torch._dynamo.reset()

    def _step(self, counts, device):
        gen = torch.Generator().manual_seed(sum(counts))
        hidden = torch.randn(sum(counts), 16, generator=gen).to(device).requires_grad_()
        probs = torch.rand(sum(counts), generator=gen).to(device).requires_grad_()
        # Each expert's activation input has its own storage (its linear_fc1's output); its
        # routing probs are a slice of the permuted probs.
        outs = [
            weighted_bias_swiglu_impl(tokens * 2, None, weights.unsqueeze(-1))
            for tokens, weights in zip(torch.split(hidden, counts), torch.split(probs, counts))
        ]
        torch.cat(outs).float().pow(2).sum().backward()
        return hidden.grad, probs.grad, outs

    def _compiled_per_step(self):
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
        compiled = []
        for counts in STEPS:
            before = {n: _graphs(n) for n in ('weighted_swiglu', 'weighted_swiglu_back')}
            self._step(counts, device)
            compiled.append({n: _graphs(n) - before[n] for n in before})
        return compiled

    def test_one_graph_for_every_token_count(self, monkeypatch):
        # every forward call compiled, however few its elements
        monkeypatch.setattr(routed_token_fuser, 'SMALL_ELEMENTS', 0)
        compiled = self._compiled_per_step()
        # the first step: a graph per direction, and at most one more for the probs slices that
        # start inside their storage (a symbolic storage offset)
        assert all(n in (1, 2) for n in compiled[0].values()), compiled[0]
        assert compiled[1:] == [{'weighted_swiglu': 0, 'weighted_swiglu_back': 0}] * 5

    def test_small_forward_calls_run_eagerly(self):
        # these calls hold far fewer elements than SMALL_ELEMENTS: the forward compiles nothing,
        # the backward as above
        compiled = self._compiled_per_step()
        assert [c['weighted_swiglu'] for c in compiled] == [0] * len(STEPS), compiled
        assert compiled[0]['weighted_swiglu_back'] in (1, 2), compiled[0]
        assert [c['weighted_swiglu_back'] for c in compiled[1:]] == [0] * 5, compiled

    @pytest.mark.parametrize('small', [None, 0])
    def test_matches_eager(self, small, monkeypatch):
        if small is not None:  # the forward compiled too
            monkeypatch.setattr(routed_token_fuser, 'SMALL_ELEMENTS', small)
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
        for counts in STEPS:
            got = self._step(counts, device)
            with torch.compiler.set_stance('force_eager'):
                want = self._step(counts, device)
            torch.testing.assert_close(got[0], want[0])
            torch.testing.assert_close(got[1], want[1])
            torch.testing.assert_close(torch.cat(got[2]), torch.cat(want[2]))


@pytest.mark.skipif(jit.jit_fuser is not torch.compile, reason="jit_fuser is not torch.compile")
class TestMoEBiasDropoutAdd:
    """A MoE layer's step waits on the host: its bias-dropout-add runs unfused below
    SMALL_ELEMENTS elements of the residual, compiled above it; dense layers are not wrapped."""

    def setup_method(self, method):
        torch._dynamo.reset()

    def teardown_method(self, method):
        torch._dynamo.reset()

    def _graphs(self):
        fn = inspect.unwrap(fused_bias_dropout.bias_dropout_add_fused_train)
        return len(_debug_get_cache_entry_list(fn))

    def _run(self, get_bda):
        gen = torch.Generator().manual_seed(49)
        x, residual = (torch.randn(6, 1, 8, generator=gen).requires_grad_() for _ in range(2))
        out = get_bda(True, True)((x, None), residual, 0.0)
        out.pow(2).sum().backward()
        return out, x.grad, residual.grad

    def test_small_calls_run_unfused(self, monkeypatch):
        get_bda = routed_token_fuser.moe_bias_dropout_add(fused_bias_dropout.get_bias_dropout_add)
        got = self._run(get_bda)
        assert self._graphs() == 0
        monkeypatch.setattr(routed_token_fuser, 'SMALL_ELEMENTS', 0)
        want = self._run(get_bda)
        assert self._graphs() == 1
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)

    def test_one_function_per_getter_call_args(self):
        get_bda = routed_token_fuser.moe_bias_dropout_add(fused_bias_dropout.get_bias_dropout_add)
        assert get_bda(True, True) is get_bda(True, True)
        assert get_bda(False, True) is get_bda(False, True)

    def test_one_graph_in_a_compiled_region(self, monkeypatch):
        # A layer compiled whole: the fused function at every size, with no guard on the size.
        monkeypatch.setattr(routed_token_fuser, 'SMALL_ELEMENTS', 64)
        get_bda = routed_token_fuser.moe_bias_dropout_add(fused_bias_dropout.get_bias_dropout_add)
        bda = get_bda(True, True)
        counter = CompileCounter()
        region = torch.compile(lambda x, r: bda((x, None), r, 0.0), backend=counter, dynamic=True)
        gen = torch.Generator().manual_seed(49)
        for tokens in (4, 32, 2, 64):  # 32, 256, 16 and 512 elements
            x, residual = torch.randn(2, tokens, 1, 8, generator=gen)
            torch.testing.assert_close(region(x, residual), x + residual, rtol=0, atol=0)
        assert counter.frame_count == 1

    def test_other_getters_unchanged(self):
        assert routed_token_fuser.moe_bias_dropout_add(IdentityFuncOp) is IdentityFuncOp
