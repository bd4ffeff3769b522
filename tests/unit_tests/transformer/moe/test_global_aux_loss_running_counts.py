# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

TOPK, EXPERTS, HIDDEN, COEFF = 2, 4, 8, 0.1
VALID = (16, 5)  # valid tokens of the two microbatches, of 8 x 2


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _microbatch(m):
    x = torch.randn(8, 2, HIDDEN, generator=_gen(1 + m), dtype=torch.float64)
    mask = torch.zeros(8, 2, dtype=torch.bool)  # True = padding
    mask.view(-1)[VALID[m] :] = True
    return x, mask


def _weight():
    return torch.randn(EXPERTS, HIDDEN, generator=_gen(0), dtype=torch.float64)


def _definition_grad():
    """d/dW of coeff * sum_m E * sum_i f_i^(m) P_i^(m), f^(m) = the step's counts so far over its
    tokens so far (float64, no megatron code)."""
    w = _weight().requires_grad_(True)
    counts, tokens, loss = torch.zeros(EXPERTS, dtype=torch.float64), 0.0, 0.0
    for m in range(len(VALID)):
        x, mask = _microbatch(m)
        scores = torch.softmax(x.reshape(-1, HIDDEN)[~mask.reshape(-1)] @ w.t(), dim=-1)
        top = torch.topk(scores.detach(), TOPK, dim=-1).indices
        counts = counts + torch.zeros_like(scores).scatter(1, top, 1.0).sum(0)
        tokens += scores.shape[0]
        f = counts / (TOPK * tokens)
        loss = loss + COEFF * EXPERTS * (f * scores.mean(0)).sum()
    loss.backward()
    return w.grad


def _router_grad():
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        params_dtype=torch.float64,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_router_dtype="fp64",
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=COEFF,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    router = TopKRouter(
        config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    ).cuda()
    with torch.no_grad():
        router.weight.copy_(_weight())
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1).cuda())
    for m in range(len(VALID)):  # one step, two microbatches: no reset in between
        x, mask = _microbatch(m)
        probs, _ = router(x.cuda(), padding_mask=mask.cuda())
        (probs * 0).sum().backward()
    return router.weight.grad.detach().double().cpu()


class TestGlobalAuxLossRunningCounts:
    """The global aux loss's expert fractions are the step's counts so far over the step's tokens
    so far. Upstream divided the counts' mean over the microbatches by the current microbatch's
    token count: with 16 then 5 valid tokens, the second microbatch's f was (16 + 5) / 2 / 5 =
    2.1 times too large."""

    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_router_grad_is_the_definitions(self):
        expected = _definition_grad()
        got = _router_grad()
        # the running counts are float32
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-9), (got - expected).abs().max()
