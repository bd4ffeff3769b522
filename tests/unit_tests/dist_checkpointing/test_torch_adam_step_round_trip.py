# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""torch Adam's step through DistributedOptimizer checkpoints (no apex, no Transformer Engine)."""

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
    """Three plain bf16 parameters."""

    def __init__(self, config, seed):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, generator=generator).to(torch.bfloat16))
            for n in (70, 130, 90)
        )


@pytest.fixture
def torch_adam(monkeypatch):
    """The optimizer megatron uses when neither apex nor Transformer Engine is installed."""
    import megatron.core.optimizer as optimizer_module

    monkeypatch.setattr(optimizer_module, 'Adam', torch.optim.AdamW)
    monkeypatch.setattr(distrib_optimizer, 'HAVE_APEX_OR_TE', False)
    monkeypatch.setattr(distrib_optimizer, 'USING_TE_OPTIMIZER', False)
    monkeypatch.setattr(distrib_optimizer, 'USING_APEX_OPTIMIZER', False)


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
            optimizer='adam', lr=1e-2, bf16=True, use_distributed_optimizer=True, clip_grad=0.0
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
    optimizer.step()


def _local_state(optimizer):
    """Every main param and optimizer-state tensor of this rank, step included."""
    tensors = {}
    for distopt in optimizer.chained_optimizers:
        for g, group in enumerate(distopt.optimizer.param_groups):
            for i, main_param in enumerate(group['params']):
                tensors[(g, i, 'param')] = main_param.detach().cpu().clone()
                state = distopt.optimizer.state[main_param]
                for key in sorted(state):
                    tensors[(g, i, key)] = state[key].detach().cpu().clone()
    return tensors


def _steps(optimizer):
    return [
        distopt.optimizer.state[p]['step']
        for distopt in optimizer.chained_optimizers
        for group in distopt.optimizer.param_groups
        for p in group['params']
    ]


@pytest.mark.skipif(
    not is_torch_min_version("2.6a0"), reason="dp_reshardable requires PyTorch 2.6a0 or later"
)
class TestTorchAdamStepRoundTrip:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize('sharding', ['dp_reshardable', 'fully_reshardable'])
    @pytest.mark.parametrize('load_steps', [0, 1])
    def test_resume_continues_the_run(self, torch_adam, tmp_path_dist_ckpt, sharding, load_steps):
        """Saved after 3 steps, loaded into a fresh (0) or a stepped (1) optimizer: the state,
        step included, equals the saved one, and the next step equals the uninterrupted run's."""
        metadata = {'distrib_optim_sharding_type': sharding}
        model_a, opt_a = _model_and_optimizer(seed=2, steps=3)
        with TempNamedDir(tmp_path_dist_ckpt / f'torch_adam_step_{sharding}') as ckpt_dir:
            save(opt_a.sharded_state_dict(_model_state(model_a), metadata=metadata), ckpt_dir)
            model_b, opt_b = _model_and_optimizer(seed=3, steps=load_steps)
            template = opt_b.sharded_state_dict(
                _model_state(model_b), is_loading=True, metadata=metadata
            )
            opt_b.load_state_dict(load(template, ckpt_dir))
        saved, loaded = _local_state(opt_a), _local_state(opt_b)
        assert saved.keys() == loaded.keys() and any(k[2] == 'step' for k in saved)
        for key in saved:
            assert torch.equal(saved[key], loaded[key]), f"{key} differs after the load"
        steps = _steps(opt_b)
        assert len({id(s) for s in steps}) == len(steps), "params share one step tensor"
        _step(model_a, opt_a, torch.Generator().manual_seed(7))
        _step(model_b, opt_b, torch.Generator().manual_seed(7))
        after_a, after_b = _local_state(opt_a), _local_state(opt_b)
        for key in after_a:
            assert torch.equal(after_a[key], after_b[key]), f"{key} differs after the next step"
        assert [s.item() for s in _steps(opt_b)] == [4.0] * len(steps)
