# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""dp_reshardable checkpoints: a rank whose part of a bucket holds no param.

Params start at 64-element boundaries in a DDP bucket, so a bucket has gaps between params.
With enough data-parallel ranks, one rank's part of a bucket can lie entirely inside such a gap:
it holds no param of the bucket, but the bucket's checkpoint tensor still has to be covered
there. Such a rank saves one padding entry for its part (and skips it on load, as every padding
entry); a rank whose part lies entirely past the bucket's unpadded end saves nothing.
"""

import torch


def local_numel_unpadded(bucket, data_parallel_rank: int, data_parallel_world_size: int) -> int:
    """How many elements of ``bucket``'s checkpoint tensor (its unpadded size) this rank holds."""
    local_numel = bucket.grad_data.numel() // data_parallel_world_size
    return min(local_numel, max(0, bucket.numel_unpadded - data_parallel_rank * local_numel))


def _padding_layout(optimizer, device):
    """{state key: dtype} of one saved entry, and the device of its tensors.

    Taken from any param this rank holds (the keys every rank saves); a rank that holds none
    uses the main param and the optimizer's state keys, in their configured dtypes.
    """
    for gbuf_range_maps in optimizer.gbuf_ranges:
        for gbuf_range_map_for_all_buckets in gbuf_range_maps.values():
            for gbuf_range_map in gbuf_range_map_for_all_buckets:
                for model_param in gbuf_range_map["param_map"]:
                    tensors = optimizer._get_main_param_and_optimizer_states(model_param)
                    tensors = {k: v for k, v in tensors.items() if v.dim() == 1}
                    device = next(iter(tensors.values())).device
                    return {key: value.dtype for key, value in tensors.items()}, device
    keys = getattr(optimizer, 'optimizer_state_keys', ('exp_avg', 'exp_avg_sq'))
    dtypes = {'param': torch.float32}
    for key in keys:
        dtypes[key] = getattr(optimizer.config, f'{key}_dtype', torch.float32)
    return dtypes, device


def gap_padding_entry(optimizer, gbuf_idx: int, bucket_idx: int, numel: int) -> dict:
    """The padding entry of a rank whose ``numel`` elements of a bucket hold no param."""
    device = optimizer.buffers[gbuf_idx].buckets[bucket_idx].grad_data.device
    dtypes, device = _padding_layout(optimizer, device)
    entry = {key: torch.empty(numel, dtype=dtype, device=device) for key, dtype in dtypes.items()}
    entry.update(gbuf_local_start=0, gbuf_local_end=numel, padding=True)
    return entry
