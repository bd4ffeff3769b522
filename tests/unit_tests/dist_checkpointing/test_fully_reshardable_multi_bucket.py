# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""fully_reshardable DistributedOptimizer checkpoints of a grad buffer with several buckets."""

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor, load, save
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import is_torch_min_version
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.test_utilities import Utils

# Module order; the grad buffer lays the params out in reverse. None of the sizes is a multiple
# of 64, so with bucket_size 150 every bucket gets bucket-end padding.
PARAM_SIZES = (70, 130, 90, 200, 33)


class Params(MegatronModule):
    """Replicated plain parameters."""

    def __init__(self, config, seed):
        super().__init__(config=config)
        generator = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, generator=generator).to(torch.bfloat16))
            for n in PARAM_SIZES
        )

    def sharded_state_dict(self):
        replica_id = (0, 0, Utils.rank)
        return {
            name: ShardedTensor.from_rank_offsets(name, param, replica_id=replica_id)
            for name, param in self.named_parameters()
        }


def _model_and_optimizer(seed):
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    model = Params(config, seed).cuda()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=150
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
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
    return model, optimizer


@pytest.mark.skipif(
    not is_torch_min_version("2.6a0"), reason="fully_reshardable requires PyTorch 2.6a0 or later"
)
@pytest.mark.parametrize('mem_efficient', [False, True])
def test_fully_reshardable_multi_bucket_round_trip(tmp_path_dist_ckpt, mem_efficient):
    """Every param's saved state equals the optimizer's own shard of it, in every bucket."""
    Utils.initialize_model_parallel(1, 1)
    try:
        model, optimizer = _model_and_optimizer(seed=2)
        (distopt,) = optimizer.chained_optimizers
        (buffer,) = distopt.buffers
        assert len(buffer.buckets) > 1
        assert any(b.grad_data.numel() > b.numel_unpadded for b in buffer.buckets[:-1])

        metadata = {
            'distrib_optim_sharding_type': 'fully_reshardable',
            'distrib_optim_fully_reshardable_mem_efficient': mem_efficient,
        }
        with TempNamedDir(tmp_path_dist_ckpt / 'fully_reshardable_multi_bucket') as ckpt_dir:
            save(
                optimizer.sharded_state_dict(model.module.sharded_state_dict(), metadata=metadata),
                ckpt_dir,
            )
            other_model, other_optimizer = _model_and_optimizer(seed=3)
            loaded = load(
                other_optimizer.sharded_state_dict(
                    other_model.module.sharded_state_dict(), is_loading=True, metadata=metadata
                ),
                ckpt_dir,
            )

        # sharded_param_state_fully_reshardable numbers the params in param_index_map order.
        loaded_state = loaded['param_state']
        checked = 0
        for param_idx, model_param in enumerate(buffer.param_index_map):
            (gbuf_range_maps,) = distopt.gbuf_ranges[0].values()
            for gbuf_range_map in gbuf_range_maps:
                if model_param not in gbuf_range_map['param_map']:
                    continue
                param_range = gbuf_range_map['param_map'][model_param]['param']
                expected = distopt._get_main_param_and_optimizer_states(model_param)
                for key in ('param', 'exp_avg', 'exp_avg_sq'):
                    saved = loaded_state[param_idx][key].flatten().cpu()
                    saved = saved[param_range.start : param_range.end]
                    differ = int((saved != expected[key].detach().cpu()).sum())
                    assert (
                        differ == 0
                    ), f"param {param_idx} {key}: {differ} of {saved.numel()} differ"
                    checked += 1
        assert checked > 0
    finally:
        Utils.destroy_model_parallel()
