# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Tell DDP model chunks how many microbatches a forward/backward call runs."""

from typing import List, Union

import torch


def set_num_microbatches(
    model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int, no_sync_func
):
    """
    Called by the schedules before the first microbatch of a forward/backward call that runs
    backward. DDP with overlap_grad_reduce dispatches each grad reduce when the grad-ready counts
    match its calibration batch; without no_sync_func those counts depend on the number of
    microbatches, so the chunks recalibrate when it changes (DistributedDataParallel.
    set_num_microbatches). Chunks without that method are skipped.

    Args:
        model: the model chunk or chunks of the schedule.
        num_microbatches (int): microbatches of this call (per model chunk).
        no_sync_func: config.no_sync_func (None: every microbatch's backward syncs grads).
    """
    for model_chunk in model if isinstance(model, list) else [model]:
        chunk_set_num_microbatches = getattr(model_chunk, 'set_num_microbatches', None)
        if chunk_set_num_microbatches is not None:
            chunk_set_num_microbatches(num_microbatches, no_sync=no_sync_func is not None)
