# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Agree on the MoE metric entries across pipeline stages before they are all-reduced."""

from typing import List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection


def agree_metric_names_across_pp(
    tracker, metric_names: List[str], pg_collection: Optional[ProcessGroupCollection] = None
) -> List[str]:
    """Return the names of ``metric_names`` that some pipeline stage recorded, in one order on
    every stage, and create the entries that this stage lacks (zeros of the recording stage's
    size).

    ``MoEMetricsTracker._sync_metrics`` all-reduces each entry over the PP group and skips names
    that this rank has no entry for; a stage without MoE layers has none, so the stages with
    MoE layers would wait in that all-reduce forever. Megatron's training loop avoids it with
    ``force_initialize=True``; this does the same from what the stages recorded, for any caller.
    """
    if pg_collection is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    else:
        pp_group = pg_collection.pp
    if pp_group is None or torch.distributed.get_world_size(group=pp_group) == 1:
        return metric_names
    local = [
        (name, tracker.metrics[name].values.numel())
        for name in metric_names
        if name in tracker.metrics
    ]
    gathered = [None] * torch.distributed.get_world_size(group=pp_group)
    torch.distributed.all_gather_object(gathered, local, group=pp_group)
    sizes = {}
    for stage_entries in gathered:
        for name, size in stage_entries:
            sizes.setdefault(name, size)
    for name, size in sizes.items():
        tracker.ensure_initialized(name, size)
    return list(sizes)
