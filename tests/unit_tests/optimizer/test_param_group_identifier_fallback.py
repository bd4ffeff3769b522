# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Param groups whose identifier changed since the checkpoint still pair on load."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor, load, save
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import is_torch_min_version
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.test_utilities import Utils


def _group(max_lr, **extra):
    group = {'wd_mult': 1.0, 'lr_mult': 1.0, 'is_expert_parallel': False}
    group.update(is_decoupled_lr=False, max_lr=max_lr, min_lr=max_lr / 10, **extra)
    return group


class TestFilterAndReorder:
    """MegatronOptimizer._filter_and_reorder_param_groups (the non-distributed optimizers)."""

    def _pair(self, current, saved):
        for index, group in enumerate(saved):
            group['params'] = [index]
            group['tag'] = index
        final = MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
        return [group['tag'] for group in final]

    def test_new_lr_pairs_by_the_old_identifier(self):
        assert self._pair([_group(5e-3)], [_group(1e-2)]) == [0]

    def test_groups_saved_without_lr_bounds(self):
        saved = [_group(1e-2), _group(1e-2, wd_mult=0.0)]
        for group in saved:
            del group['max_lr'], group['min_lr']
        assert self._pair([_group(1e-2, wd_mult=0.0), _group(1e-2)], saved) == [1, 0]

    def test_changed_bounds_of_groups_that_share_the_old_identifier(self):
        saved = [_group(1e-2), _group(2e-2)]
        assert self._pair([_group(5e-3), _group(4e-3)], saved) == [0, 1]

    def test_unchanged_groups_keep_their_own_bounds(self):
        saved = [_group(3e-2), _group(1e-2)]
        assert self._pair([_group(1e-2), _group(3e-2)], saved) == [1, 0]

    def test_added_group_pairs_with_the_only_saved_group(self):
        """Two current groups, one saved group of their old identifier (and one of another):
        both take the saved group's fields, each with its own params."""
        saved = [_group(1e-2), _group(1e-2, wd_mult=0.0)]
        assert self._pair([_group(5e-3), _group(4e-3)], saved) == [0, 0]
        final = MegatronOptimizer._filter_and_reorder_param_groups(
            [_group(5e-3), _group(4e-3)], saved
        )
        assert [group['params'] for group in final] == [[0], [1]]

    def test_changed_overrides_that_may_swap_are_refused(self):
        """Overridden groups are built in the order of their override values: two of them that
        changed (built as 4e-3 before 6e-3, saved as 2e-2 before 3e-2; which was which?) are
        not paired by position."""
        saved = [_group(1e-2, default_config=True)]
        saved += [_group(lr, default_config=False) for lr in (2e-2, 3e-2)]
        current = [_group(1e-2, default_config=True)]
        current += [_group(lr, default_config=False) for lr in (4e-3, 6e-3)]
        with pytest.raises(ValueError, match='Could not find parameter group'):
            self._pair(current, saved)

    def test_ambiguous_pairing_still_fails(self):
        saved = [_group(1e-2), _group(2e-2), _group(3e-2)]
        with pytest.raises(ValueError, match='Could not find parameter group'):
            self._pair([_group(5e-3), _group(4e-3)], saved)


class Params(MegatronModule):
    """Three plain bf16 parameters; ``p.1`` gets its own LR bounds."""

    def __init__(self, config, seed):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, generator=generator).to(torch.bfloat16))
            for n in (40, 24, 8)
        )


def _run(seed, lr, p1_lr, override, steps):
    """A DistributedOptimizer and its scheduler; ``steps`` steps on seeded gradients."""
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
            lr=lr,
            min_lr=lr / 10,
            bf16=True,
            use_distributed_optimizer=True,
            clip_grad=0.0,
        ),
        [model],
        config_overrides={ParamKey(name='*.p.1'): {'max_lr': p1_lr, 'min_lr': p1_lr / 10}},
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=lr / 10,
        lr_warmup_steps=2,
        lr_decay_steps=20,
        lr_decay_style='cosine',
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=20,
        wd_incr_style='constant',
        use_checkpoint_opt_param_scheduler=not override,
        override_opt_param_scheduler=override,
    )
    generator = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):
        model.zero_grad_buffer()
        for param in model.module.parameters():
            param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=generator))
        optimizer.step()
        scheduler.step(increment=1)
    return model, optimizer, scheduler


def _model_state(model):
    dp_rank = parallel_state.get_data_parallel_rank()
    return {
        name: ShardedTensor.from_rank_offsets(name, param, replica_id=(0, 0, dp_rank))
        for name, param in model.module.named_parameters()
    }


def _bounds(optimizer):
    return [(g['lr'], g['max_lr'], g['min_lr']) for g in optimizer.param_groups]


@pytest.mark.skipif(
    not is_torch_min_version("2.6a0"), reason="dp_reshardable requires PyTorch 2.6a0 or later"
)
class TestDistributedOptimizerResume:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize(
        'resume_lr, resume_p1_lr, override', [(5e-3, 4e-3, True), (1e-2, 3e-2, False)]
    )
    def test_resume(self, tmp_path_dist_ckpt, resume_lr, resume_p1_lr, override):
        """Saved at step 3 with LR 1e-2 (p.1: 3e-2), loaded with new LRs and
        --override-opt-param-scheduler, or with the same LRs: every group has the LR and bounds
        of a run built with the resume arguments and stepped to step 3 (``expected``)."""
        metadata = {'distrib_optim_sharding_type': 'dp_reshardable'}
        model_a, opt_a, sched_a = _run(2, 1e-2, 3e-2, override=False, steps=3)
        _, opt_c, _ = _run(3, resume_lr, resume_p1_lr, override=override, steps=3)
        expected = _bounds(opt_c)
        assert expected[0] != expected[1]
        with TempNamedDir(tmp_path_dist_ckpt / 'param_group_identifier_fallback') as ckpt_dir:
            state = opt_a.sharded_state_dict(_model_state(model_a), metadata=metadata)
            save(state, ckpt_dir)
            model_b, opt_b, sched_b = _run(3, resume_lr, resume_p1_lr, override, steps=0)
            state = opt_b.sharded_state_dict(
                _model_state(model_b), is_loading=True, metadata=metadata
            )
            opt_b.load_state_dict(load(state, ckpt_dir))
            sched_b.load_state_dict(sched_a.state_dict())
        assert _bounds(opt_b) == expected
