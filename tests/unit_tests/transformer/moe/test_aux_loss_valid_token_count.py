# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_tokens_per_expert_and_token_count,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

TOPK, EXPERTS, HIDDEN = 2, 4, 8


def _padding_mask(rank, seq=4, bsz=2):
    """True = padding; TP rank r pads r + 1 tokens, so the ranks hold different valid counts."""
    mask = torch.zeros(seq, bsz, dtype=torch.bool)
    mask.view(-1)[: rank + 1] = True
    return mask


def _router_weight_grad(loss_type, per_token):
    """The router weight's grad from the aux loss alone, summed over TP (sequence parallel) and,
    under per-token loss, divided by the replica's valid tokens (as finalize_model_grads does)."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_router_load_balancing_type=loss_type,
        moe_aux_loss_coeff=0.1,
        calculate_per_token_loss=per_token,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    router = TopKRouter(
        config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    ).cuda()
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=_gen(0)))
    rank = parallel_state.get_tensor_model_parallel_rank()
    x = torch.randn(4, 2, HIDDEN, generator=_gen(1 + rank)).cuda()
    mask = _padding_mask(rank).cuda()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1).cuda())
    probs, _ = router(x, padding_mask=mask)
    (probs * 0).sum().backward()
    grad = router.weight.grad.detach().clone()
    torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    if per_token:
        valid = (~mask).sum()
        torch.distributed.all_reduce(valid, group=parallel_state.get_tensor_model_parallel_group())
        grad /= valid
    return grad


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class TestAuxLossValidTokenCount:
    """With a padding mask, get_tokens_per_expert_and_token_count reduced the per-expert counts
    over TP x CP in place, so its "local" valid count was the reduced one; the per-token rescale
    of the global aux loss then summed it over TP x CP again: its gradient came out TP x CP times
    the gradient of the loss (2x at TP 2)."""

    def setup_method(self, method):
        if Utils.world_size < 2 or Utils.world_size % 2:
            pytest.skip("needs an even world size of at least 2 (TP 2)")
        Utils.initialize_model_parallel(tensor_model_parallel_size=2)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    def test_local_count_stays_local(self):
        rank = parallel_state.get_tensor_model_parallel_rank()
        mask = _padding_mask(rank).reshape(-1)
        routing_map = torch.zeros(mask.numel(), EXPERTS, dtype=torch.bool)
        routing_map[:, :TOPK] = True
        routing_map[mask] = False
        _, local, total = get_tokens_per_expert_and_token_count(
            routing_map.cuda(),
            reduce_group=parallel_state.get_tensor_model_parallel_group(),
            topk=TOPK,
            with_padding_mask=True,
        )
        assert int(local) == int((~mask).sum())
        assert int(total) == sum(8 - (r + 1) for r in range(2))

    @pytest.mark.internal
    def test_global_aux_loss_per_token_matches_mean_loss(self):
        mean = _router_weight_grad('global_aux_loss', per_token=False)
        per_token = _router_weight_grad('global_aux_loss', per_token=True)
        assert mean.abs().max() > 0
        torch.testing.assert_close(per_token, mean, rtol=1e-5, atol=1e-7)
