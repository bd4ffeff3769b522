# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Checkpoints of a distributed optimizer that has not stepped yet.

torch's Adam/AdamW and TE's FusedAdam create their per-param state in their first step. Until
then (for instance while fp16's loss scaler skips every step), the optimizer has no state to save,
but a restarted process loads through a template that asks for every state tensor (``exp_avg``,
``exp_avg_sq``, ...). So such an optimizer saves the state it would start from, what its
``init_state_fn`` builds, without keeping it. A load of such a checkpoint of torch's optimizers
(step 0 in every param group) leaves the optimizer without state again, so that its first step
initializes the state itself, as in the run that never stopped.
"""

from typing import Any, Dict


def init_state_for_save(optimizer) -> bool:
    """Give a never-stepped optimizer the state it starts from, for a save.

    Args:
        optimizer: a DistributedOptimizer (``optimizer.optimizer`` is the wrapped optimizer).

    Returns:
        True when the state was created here; the caller drops it with
        :func:`drop_state` once the save's state dict holds its tensors.
    """
    inner = optimizer.optimizer
    if optimizer.init_state_fn is None or any(len(s) > 0 for s in inner.state.values()):
        return False
    optimizer.init_state_fn(inner, optimizer.config)
    return True


def drop_state(optimizer) -> None:
    """Leave the wrapped optimizer without per-param state, as before its first step."""
    optimizer.optimizer.state.clear()


def saved_before_first_step(state_dict: Dict[str, Any]) -> bool:
    """Whether a loaded state dict comes from a torch optimizer that had not stepped.

    Such a state dict records step 0 in every param group: torch's optimizers count the step
    before they use it, so an optimizer that stepped records 1 or more.
    """
    groups = state_dict.get("optimizer", {}).get("param_groups", [])
    return len(groups) > 0 and all(group.get("step") == 0 for group in groups)
