# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Adam's step of the CPU-offload optimizer (HybridDeviceOptimizer) through checkpoints."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor, load, save
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, distrib_optimizer, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import is_torch_min_version
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.test_utilities import Utils


class Params(MegatronModule):
    """Four plain bf16 parameters."""

    def __init__(self, config, seed):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, generator=generator).to(torch.bfloat16))
            for n in (2048, 130, 517, 64)
        )


@pytest.fixture
def adam_layout(monkeypatch, request):
    """'torch': no apex or Transformer Engine. 'te': the distributed optimizer's apex/TE
    branches. Every param is offloaded, so torch's AdamW on the CPU is the only sub-optimizer."""
    import megatron.core.optimizer as optimizer_module

    torch_layout = request.param == 'torch'
    monkeypatch.setattr(distrib_optimizer, 'HAVE_APEX_OR_TE', not torch_layout)
    monkeypatch.setattr(distrib_optimizer, 'USING_TE_OPTIMIZER', not torch_layout)
    monkeypatch.setattr(distrib_optimizer, 'USING_APEX_OPTIMIZER', False)
    if torch_layout:
        monkeypatch.setattr(optimizer_module, 'Adam', torch.optim.AdamW)
    return request.param


def _model_and_optimizer(seed, steps):
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = DistributedDataParallel(
        config=config, ddp_config=ddp_config, module=Params(config, seed).cuda()
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam',
            lr=1e-2,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=1.0,
            clip_grad=0.0,
        ),
        [model],
    )
    generator = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):
        _step(model, optimizer, generator)
    return model, optimizer


def _model_state(model):
    """The params as replicated ShardedTensors (kept as tensors, so the optimizer finds them)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    return {
        name: ShardedTensor.from_rank_offsets(name, param, replica_id=(0, 0, dp_rank))
        for name, param in model.module.named_parameters()
    }


def _step(model, optimizer, generator):
    model.zero_grad_buffer()
    for param in model.module.parameters():
        param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=generator))
    assert optimizer.step()[0]


def _steps(optimizer):
    """The step of every param state of every sub-optimizer."""
    return [
        state['step'].item()
        for distopt in optimizer.chained_optimizers
        for sub_optimizer in distopt.optimizer.sub_optimizers
        for state in sub_optimizer.state.values()
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CPU-offload optimizer needs CUDA")
@pytest.mark.skipif(
    not is_torch_min_version("2.6a0"), reason="dp_reshardable requires PyTorch 2.6a0 or later"
)
class TestCpuOffloadStepRoundTrip:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize('adam_layout', ['torch', 'te'], indirect=True)
    @pytest.mark.parametrize('sharding', ['dp_reshardable', 'fully_reshardable'])
    @pytest.mark.parametrize('load_steps', [0, 1])
    def test_resume_continues_the_run(self, adam_layout, tmp_path_dist_ckpt, sharding, load_steps):
        """Every param offloaded; saved after 3 steps, loaded into a fresh (0) or a stepped (1)
        optimizer: every param state has step 3, and the next steps equal the uninterrupted
        run's."""
        metadata = {'distrib_optim_sharding_type': sharding}
        model_a, opt_a = _model_and_optimizer(seed=2, steps=3)
        with TempNamedDir(tmp_path_dist_ckpt / f'cpu_offload_step_{sharding}') as ckpt_dir:
            save(opt_a.sharded_state_dict(_model_state(model_a), metadata=metadata), ckpt_dir)
            model_b, opt_b = _model_and_optimizer(seed=3, steps=load_steps)
            template = opt_b.sharded_state_dict(
                _model_state(model_b), is_loading=True, metadata=metadata
            )
            opt_b.load_state_dict(load(template, ckpt_dir))
        with torch.no_grad():
            for param, saved in zip(model_b.module.parameters(), model_a.module.parameters()):
                param.copy_(saved)
        steps = _steps(opt_b)
        assert steps and steps == [3.0] * len(steps), f"steps after the load: {steps}"
        for step in range(2):
            _step(model_a, opt_a, torch.Generator().manual_seed(7 + step))
            _step(model_b, opt_b, torch.Generator().manual_seed(7 + step))
            for i, (param_a, param_b) in enumerate(
                zip(model_a.module.parameters(), model_b.module.parameters())
            ):
                assert torch.equal(param_a, param_b), f"param {i} differs after step {step + 1}"
        assert _steps(opt_b) == [5.0] * len(steps)
