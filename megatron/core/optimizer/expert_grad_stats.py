# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Expert-aware bookkeeping for gradient statistics (grad norm and zero count).

The duplicate filter behind the grad norm and the zero count keeps a parameter that is not
tensor-parallel only on rank 0 of its tensor-parallel group. Expert parameters (marked with
``allreduce=False``) are replicated over the expert tensor-parallel group, not over the dense
one, so the filter needs both groups and the optimizers' copies of a parameter must keep the
``allreduce`` flag that tells the two kinds apart.
"""

from typing import Optional

import torch

from .. import parallel_state
from ..process_groups_config import ProcessGroupCollection

# Parameter attributes read by the gradient-statistics filters, carried over to every fp32 copy
# or sharded view an optimizer makes of a model parameter.
GRAD_STATS_PARAM_ATTRIBUTES = ('allreduce', 'shared')


def copy_grad_stats_param_attributes(
    destination: Optional[torch.Tensor], source: torch.Tensor
) -> None:
    """Copy the attributes the gradient-statistics filters read from a param to its copy.

    Args:
        destination (Optional[torch.Tensor]): the optimizer's copy or view of ``source``;
            nothing is done when it is None (e.g. no main param with precision-aware optimizers).
        source (torch.Tensor): the model parameter.
    """
    if destination is None:
        return
    for name in GRAD_STATS_PARAM_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def attach_grad_stats_tp_groups(
    optimizer, pg_collection: Optional[ProcessGroupCollection] = None
) -> None:
    """Set ``tp_group`` and ``expert_tp_group`` on an optimizer wrapper.

    Both are read when the optimizer filters tensor-parallel duplicates out of its gradient
    statistics: dense parameters use ``tp_group``, expert parameters ``expert_tp_group``.

    Args:
        optimizer: the MegatronOptimizer wrapper (FP32, mixed precision or distributed).
        pg_collection (Optional[ProcessGroupCollection]): explicit process groups; when None or
            without a ``tp`` group, the groups of the global parallel state are used. A
            collection without ``expt_tp`` leaves ``expert_tp_group`` None, which makes the filter
            fall back to ``tp_group`` for expert parameters.
    """
    if pg_collection is not None and hasattr(pg_collection, 'tp'):
        tp_group = pg_collection.tp
        expert_tp_group = getattr(pg_collection, 'expt_tp', None)
    else:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        expert_tp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    setattr(optimizer, 'tp_group', tp_group)
    setattr(optimizer, 'expert_tp_group', expert_tp_group)
