# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""dp_reshardable DistributedOptimizer checkpoints of buckets that end in padding."""

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
    """Plain parameters; the one at index ``shared`` gets a bucket of its own, and the bucket
    before it ends at the 64-aligned start of that param instead of at its last param's end."""

    def __init__(self, config, sizes, shared, seed):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, generator=generator).to(torch.bfloat16))
            for n in sizes
        )
        self.p[shared].shared_embedding = True


def _model_and_optimizer(sizes, shared, bucket_size, seed):
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=bucket_size
    )
    model = DistributedDataParallel(
        config=config, ddp_config=ddp_config, module=Params(config, sizes, shared, seed).cuda()
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam', lr=1e-2, bf16=True, use_distributed_optimizer=True, clip_grad=0.0
        ),
        [model],
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
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


def _round_trip(ckpt_dir, **kwargs):
    optimizer = _model_and_optimizer(seed=2, **kwargs)
    save(optimizer.sharded_state_dict({}, metadata=METADATA), ckpt_dir)
    other = _model_and_optimizer(seed=3, **kwargs)
    other.load_state_dict(
        load(other.sharded_state_dict({}, is_loading=True, metadata=METADATA), ckpt_dir)
    )
    saved, loaded = _local_state(optimizer), _local_state(other)
    assert len(saved) == len(loaded) > 0
    for i, (a, b) in enumerate(zip(saved, loaded)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs after the round trip"
    return optimizer.chained_optimizers[0].buffers[0]


@pytest.mark.skipif(
    not is_torch_min_version("2.6a0"), reason="dp_reshardable requires PyTorch 2.6a0 or later"
)
class TestDpReshardableBucketEndPadding:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_last_shard_stops_at_unpadded_bucket_end(self, tmp_path_dist_ckpt):
        """Bucket 0 holds 900 + 100 elements and ends at 1088 (unpadded), padded to 1152: the
        rank that holds the end of the 100-element param must not save past 1088."""
        with TempNamedDir(tmp_path_dist_ckpt / 'dp_reshardable_bucket_end') as ckpt_dir:
            buffer = _round_trip(ckpt_dir, sizes=(1024, 100, 900), shared=0, bucket_size=None)
        assert [(b.numel_unpadded, b.grad_data.numel()) for b in buffer.buckets][0] == (1088, 1152)

    @pytest.mark.parametrize('sizes, shared', [((300, 16, 300), 1), ((16, 300), 0)])
    def test_padding_only_shard(self, tmp_path_dist_ckpt, sizes, shared):
        """A 16-element bucket padded to 128: ranks past the first hold only padding there."""
        if Utils.world_size < 2:
            pytest.skip("a padding-only shard needs a data-parallel size of 2 or more")
        with TempNamedDir(tmp_path_dist_ckpt / 'dp_reshardable_padding_only') as ckpt_dir:
            buffer = _round_trip(ckpt_dir, sizes=sizes, shared=shared, bucket_size=200)
        assert (16, 128) in [(b.numel_unpadded, b.grad_data.numel()) for b in buffer.buckets]
