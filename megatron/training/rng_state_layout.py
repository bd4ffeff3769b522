# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Where a torch_dist checkpoint keeps the RNG states: one per rank.

Megatron's RNG streams differ from rank to rank: the expert-parallel tracker stream is seeded
per EP and ETP rank, and what each rank has drawn since depends on its data. A checkpoint that
keeps one state per (PP, TP) position, with the DP x CP rank as replica id, writes DP x CP rank
0's state only and gives it to every peer on load. The RNG state is therefore a ShardedObject
over (PP, TP, DP x CP), each rank its own shard. The checkpoint's content metadata records the
DP x CP size it was saved with (``RNG_STATE_DP_CP_SIZE``); a checkpoint without it has the older
(PP, TP) layout and is loaded as it was saved. Resumed at another DP x CP size, no rank's stream
continues a saved one, so the RNG state is not loaded, as upstream already does when TP or PP
changes.
"""

from typing import Optional

from megatron.core.dist_checkpointing.mapping import ShardedObject

from .utils import print_rank_0

# Content-metadata key: the DP x CP size the per-rank RNG states were saved with.
RNG_STATE_DP_CP_SIZE = 'rng_state_dp_cp_size'


def rng_state_sharded_object(key, states, pp, tp, dp_cp, saved_dp_cp_size=None):
    """The ShardedObject of this rank's RNG states.

    Args:
        key: the object's key.
        states: what get_rng_state() collected (a list of per-rank state dicts).
        pp, tp, dp_cp: (rank, size) of this rank in each dimension.
        saved_dp_cp_size: None to save (the current layout); when loading, the DP x CP size the
            checkpoint was saved with, or 0 for a checkpoint of the (PP, TP) layout.

    Returns:
        The ShardedObject, or None when the checkpoint was saved at another DP x CP size (the
        RNG state is then not loaded).
    """
    (pp_rank, pp_size), (tp_rank, tp_size), (dp_cp_rank, dp_cp_size) = pp, tp, dp_cp
    if saved_dp_cp_size == 0:
        return ShardedObject(
            key, states, (pp_size, tp_size), (pp_rank, tp_rank), replica_id=dp_cp_rank
        )
    if saved_dp_cp_size is not None and saved_dp_cp_size != dp_cp_size:
        print_rank_0(
            f'DP x CP size {dp_cp_size} differs from the checkpoint\'s {saved_dp_cp_size}: '
            'RNG state will be ignored'
        )
        return None
    return ShardedObject(
        key, states, (pp_size, tp_size, dp_cp_size), (pp_rank, tp_rank, dp_cp_rank), replica_id=0
    )


def saved_dp_cp_size(content_metadata: Optional[dict]) -> int:
    """The DP x CP size a checkpoint's RNG states were saved with; 0 for the (PP, TP) layout."""
    return int((content_metadata or {}).get(RNG_STATE_DP_CP_SIZE, 0))
