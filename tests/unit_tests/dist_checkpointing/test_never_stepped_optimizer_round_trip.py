# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""A DistributedOptimizer checkpoint saved before the optimizer's first step (torch AdamW).

fp16's loss scaler skips every step until its scale comes down, so the optimizer may not have
stepped when a checkpoint is saved; torch's Adam creates its state in its first step.
"""

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

    def __init__(self, config):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(5)
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


def _model_and_optimizer():
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = DistributedDataParallel(
        config=config, ddp_config=ddp_config, module=Params(config).cuda()
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam', lr=1e-2, bf16=True, use_distributed_optimizer=True, clip_grad=0.0
        ),
        [model],
    )
    return model, optimizer


def _model_state(model):
    """The params as replicated ShardedTensors (kept as tensors, so the optimizer finds them)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    return {
        name: ShardedTensor.from_rank_offsets(name, param, replica_id=(0, 0, dp_rank))
        for name, param in model.module.named_parameters()
    }


def _step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
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


def _state_sizes(optimizer):
    """How many params have optimizer state, per optimizer."""
    return [
        sum(1 for state in distopt.optimizer.state.values() if state)
        for distopt in optimizer.chained_optimizers
    ]


def _saved_moments(node, key=None):
    """The exp_avg / exp_avg_sq tensors of a loaded optimizer state dict (not padding)."""
    if isinstance(node, dict) and node.get('padding') is True:
        return []
    if isinstance(node, dict):
        return [t for k, v in node.items() for t in _saved_moments(v, k)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _saved_moments(v, key)]
    if isinstance(node, torch.Tensor) and key in ('exp_avg', 'exp_avg_sq'):
        return [node]
    return []


@pytest.mark.skipif(
    not is_torch_min_version("2.6a0"), reason="dp_reshardable requires PyTorch 2.6a0 or later"
)
class TestNeverSteppedOptimizerRoundTrip:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize('sharding', ['dp_reshardable', 'fully_reshardable'])
    def test_resume_before_first_step(self, torch_adam, tmp_path_dist_ckpt, sharding):
        """Saved before any step and loaded into a fresh optimizer: the saved moments are the
        zeros Adam starts from, both optimizers stay without state, and the next step of each
        equals the step of an optimizer that was never saved (step included)."""
        metadata = {'distrib_optim_sharding_type': sharding}
        model_a, opt_a = _model_and_optimizer()
        model_r, opt_r = _model_and_optimizer()
        with TempNamedDir(tmp_path_dist_ckpt / f'never_stepped_{sharding}') as ckpt_dir:
            save(opt_a.sharded_state_dict(_model_state(model_a), metadata=metadata), ckpt_dir)
            assert _state_sizes(opt_a) == [0], "the save left state in the saved optimizer"
            model_b, opt_b = _model_and_optimizer()
            template = opt_b.sharded_state_dict(
                _model_state(model_b), is_loading=True, metadata=metadata
            )
            loaded = load(template, ckpt_dir)
            moments = _saved_moments(loaded['param_state'])
            assert moments and all(torch.count_nonzero(t) == 0 for t in moments)
            opt_b.load_state_dict(loaded)
        assert _state_sizes(opt_b) == [0], "the load left state in the loading optimizer"
        for model, opt in ((model_r, opt_r), (model_a, opt_a), (model_b, opt_b)):
            _step(model, opt, seed=7)
        ref = _local_state(opt_r)
        assert any(key[2] == 'step' for key in ref)
        for name, opt in (('saved', opt_a), ('loaded', opt_b)):
            got = _local_state(opt)
            assert got.keys() == ref.keys(), name
            for key in ref:
                assert torch.equal(got[key], ref[key]), f"{name}: {key} differs after the step"
