# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Pair the param groups of a loading optimizer with the param groups of a checkpoint.

A saved group is found by the full identifier of the current group (every
``ParamGroupOverride`` field plus the structural flags). A checkpoint written with other
per-group bounds (a run resumed with a new ``--lr`` or a changed per-module LR override, as
``--override-opt-param-scheduler`` allows) or by a release whose identifier was
``LEGACY_IDENTIFIER_KEYS`` has no group with that identifier; such a group is paired by
``LEGACY_IDENTIFIER_KEYS`` instead, the way it was paired before the identifier grew.
"""

from typing import Callable, Dict, List, Optional

# The identifier before upstream PR 4705 added the ParamGroupOverride fields.
LEGACY_IDENTIFIER_KEYS = ('wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr')

# Fields that only a per-module override puts into a param group (get_megatron_optimizer gives
# every group max_lr, min_lr and wd_mult, and default_config False to a group whose override
# sets an LR bound).
_OVERRIDE_ONLY_KEYS = ('start_wd', 'end_wd', 'optimizer')


def legacy_identifier(group: Dict) -> tuple:
    """``LEGACY_IDENTIFIER_KEYS`` of ``group`` (NeMo's ``pre_`` aliases; missing is None)."""
    return tuple(group.get(key, group.get(f"pre_{key}")) for key in LEGACY_IDENTIFIER_KEYS)


def _order_fixed(groups: List[Dict]) -> bool:
    """Whether the construction order of ``groups`` (one legacy identifier) does not depend on
    their per-module override values, which a resume may have changed.

    get_megatron_optimizer builds the group without overrides first and the others in the order
    of their override values: only a group without overrides and one other keep their order.
    """
    if len(groups) <= 1:
        return True
    first = groups[0]
    without_overrides = first.get("default_config", True) and not any(
        key in first for key in _OVERRIDE_ONLY_KEYS
    )
    return len(groups) == 2 and without_overrides


def pair_saved_param_groups(
    current_groups: List[Dict], saved_groups: List[Dict], identifier: Callable[[Dict], tuple]
) -> List[Optional[Dict]]:
    """For each current group, its saved group, or None where none can be told apart.

    1. The saved group with the same ``identifier`` (the last one, if several share it).
    2. Otherwise the saved group with the same legacy identifier, if exactly one has it.
    3. Otherwise, if the current groups left unpaired by 1. that share a legacy identifier are
       as many as the saved groups with that legacy identifier that 1. left unused, and their
       construction order does not depend on their changed override values, they are paired in
       order (the order in which both optimizers built their groups).
    """
    by_identifier = {identifier(group): group for group in saved_groups}
    paired = [by_identifier.get(identifier(group)) for group in current_groups]
    used = {id(group) for group in paired if group is not None}

    by_legacy: Dict[tuple, List[Dict]] = {}
    for group in saved_groups:
        by_legacy.setdefault(legacy_identifier(group), []).append(group)
    unpaired: Dict[tuple, List[int]] = {}
    for index, group in enumerate(current_groups):
        if paired[index] is None:
            unpaired.setdefault(legacy_identifier(group), []).append(index)

    for key, indices in unpaired.items():
        candidates = by_legacy.get(key, [])
        if len(candidates) == 1:
            for index in indices:
                paired[index] = candidates[0]
            continue
        unused = [group for group in candidates if id(group) not in used]
        if not _order_fixed([current_groups[index] for index in indices]):
            # Which saved group was whose cannot be told (two changed overrides may swap).
            continue
        if unused and len(unused) == len(indices):
            for index, group in zip(indices, unused):
                paired[index] = group
    return paired
