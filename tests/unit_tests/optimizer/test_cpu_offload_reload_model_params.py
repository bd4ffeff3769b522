# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""reload_model_params() with the CPU-offload optimizer (HybridDeviceOptimizer)."""

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from tests.unit_tests.test_utilities import Utils

# With offload fraction 0.5 some params are offloaded and some are not, in either order.
SIZES = (2048, 64, 130, 2048)


class Params(MegatronModule):
    """Plain bf16 parameters."""

    def __init__(self, config, seed):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, generator=generator).to(torch.bfloat16))
            for n in SIZES
        )


def _model_and_optimizer(precision_aware, fraction, weights=None):
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    module = Params(config, seed=1).cuda()
    if weights is not None:
        with torch.no_grad():
            for param, weight in zip(module.parameters(), weights):
                param.copy_(weight)
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        module=module,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam',
            lr=1e-2,
            weight_decay=0.01,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=precision_aware,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=fraction,
            clip_grad=0.0,
        ),
        [model],
    )
    return model, optimizer


def _step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    model.zero_grad_buffer()
    for param in model.module.parameters():
        param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=generator))
    assert optimizer.step()[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CPU-offload optimizer needs CUDA")
class TestCpuOffloadReloadModelParams:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize('fraction', [0.0, 0.5, 1.0])
    @pytest.mark.parametrize('precision_aware', [True, False])
    def test_step_after_model_only_load(self, precision_aware, fraction):
        """Weights loaded after the optimizer is built, then reload_model_params() (a model-only
        checkpoint load): the next steps equal those of an optimizer built from those weights."""
        model, optimizer = _model_and_optimizer(precision_aware, fraction)
        generator = torch.Generator().manual_seed(2)
        weights = [
            torch.randn(p.shape, generator=generator).to(p.dtype).cuda()
            for p in model.module.parameters()
        ]
        with torch.no_grad():
            for param, weight in zip(model.module.parameters(), weights):
                param.copy_(weight)
        optimizer.reload_model_params()
        ref_model, ref_optimizer = _model_and_optimizer(precision_aware, fraction, weights)
        for step in range(2):
            _step(model, optimizer, seed=10 + step)
            _step(ref_model, ref_optimizer, seed=10 + step)
            for i, (param, ref) in enumerate(
                zip(model.module.parameters(), ref_model.module.parameters())
            ):
                assert torch.equal(param, ref), f"param {i} differs after step {step + 1}"
