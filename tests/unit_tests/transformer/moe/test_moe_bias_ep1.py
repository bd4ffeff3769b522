# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


def _moe_layer(dtype):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=8,
        num_attention_heads=4,
        params_dtype=dtype,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_router_dtype='fp64' if dtype == torch.float64 else 'fp32',
        moe_token_dispatcher_type='allgather',
        add_bias_linear=True,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    return spec.submodules.mlp(config=config)


class TestMoEBiasExpertParallelOne:
    """Local experts with biases at EP = ETP = 1: the expert fc2 bias is added to the output
    (weighted by the routing probability) after linear_fc2, whose size-1 reduce returns its
    input as is. Adding it in place raised "Output 0 of _ReduceFromModelParallelRegion is a view
    and is being modified inplace" in backward's autograd checks, so such a layer could not
    train at all."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.internal
    def test_grads_match_float64(self):
        layers = {dtype: _moe_layer(dtype) for dtype in (torch.float32, torch.float64)}
        gen = torch.Generator().manual_seed(7)
        values = {
            n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5
            for n, p in layers[torch.float64].named_parameters()
        }
        x = torch.randn(4, 2, 8, generator=gen, dtype=torch.float64)
        probe = torch.randn(4, 2, 8, generator=gen, dtype=torch.float64)
        grads = {}
        for dtype, layer in layers.items():
            layer = layer.cuda()
            with torch.no_grad():
                for n, p in layer.named_parameters():
                    p.copy_(values[n].to(dtype))
            out, out_bias = layer(x.to(dtype).cuda())
            assert out_bias is None
            (out.double() * probe.cuda()).sum().backward()
            grads[dtype] = {n: p.grad.double().cpu() for n, p in layer.named_parameters()}
        assert any(n.endswith('linear_fc2.bias') for n in grads[torch.float64])
        eps = torch.finfo(torch.float32).eps
        for n, ref in grads[torch.float64].items():
            assert ref.abs().max() > 0, n
            torch.testing.assert_close(
                grads[torch.float32][n], ref, rtol=0, atol=256 * eps * max(ref.abs().max(), 1.0)
            )
