# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""dp_reshardable DistributedOptimizer checkpoints where a rank's shard lies in a param gap."""

import pytest
import torch

from megatron.core.dist_checkpointing import load, save
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import is_torch_min_version
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.test_utilities import Utils

METADATA = {'distrib_optim_sharding_type': 'dp_reshardable'}


class Params(MegatronModule):
    """Plain bf16 parameters (the grad buffer lays them out in reverse order)."""

    def __init__(self, config, sizes, seed):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, generator=generator).to(torch.bfloat16))
            for n in sizes
        )


def _model_and_optimizer(sizes, bucket_size, seed, steps):
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=bucket_size
    )
    model = DistributedDataParallel(
        config=config, ddp_config=ddp_config, module=Params(config, sizes, seed).cuda()
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam', lr=1e-2, bf16=True, use_distributed_optimizer=True, clip_grad=0.0
        ),
        [model],
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.zero_grad_buffer()
        for param in model.module.parameters():
            param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=generator))
        optimizer.step()
    return optimizer


def _local_state(optimizer):
    """Every main param and optimizer-state tensor of this rank, in a fixed order."""
    tensors = []
    for distopt in optimizer.chained_optimizers:
        for group in distopt.optimizer.param_groups:
            for main_param in group['params']:
                tensors.append(main_param.detach().cpu().clone())
                state = distopt.optimizer.state[main_param]
                tensors += [state[k].detach().cpu().clone() for k in sorted(state)]
    return tensors


@pytest.mark.skipif(
    not is_torch_min_version("2.6a0"), reason="dp_reshardable requires PyTorch 2.6a0 or later"
)
class TestDpReshardableGapShard:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize(
        'sizes, bucket_size',
        [
            # One bucket [1 at 0, 64 at 64]: at DP 4, rank 1's shard [32, 64) is all gap.
            ((64, 1), None),
            # Buckets [1, 64 | 256 | 1]: the same gap in the first bucket, and rank 1's part of
            # the last one lies past its unpadded end (saved as nothing).
            ((1, 256, 64, 1), 65),
        ],
    )
    def test_gap_shard_round_trip(self, tmp_path_dist_ckpt, sizes, bucket_size):
        if Utils.world_size != 4:
            pytest.skip("the shard inside the gap needs a data-parallel size of 4")
        optimizer = _model_and_optimizer(sizes, bucket_size, seed=2, steps=2)
        ranges = optimizer.chained_optimizers[0].gbuf_ranges[0]
        assert [len(r['param_map']) for r in next(iter(ranges.values()))][0] == (
            0 if Utils.rank == 1 else 1
        )
        with TempNamedDir(tmp_path_dist_ckpt / 'dp_reshardable_gap_shard') as ckpt_dir:
            save(optimizer.sharded_state_dict({}, metadata=METADATA), ckpt_dir)
            other = _model_and_optimizer(sizes, bucket_size, seed=3, steps=0)
            other.load_state_dict(
                load(other.sharded_state_dict({}, is_loading=True, metadata=METADATA), ckpt_dir)
            )
        saved, loaded = _local_state(optimizer), _local_state(other)
        assert len(saved) == len(loaded)
        for i, (a, b) in enumerate(zip(saved, loaded)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs after the load"
