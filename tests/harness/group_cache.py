"""Reuse process groups across model-parallel initializations in one harness world (test-only).

A gloo process group keeps its threads until the process exits: ``destroy_process_group`` does
not give them back. A layout sweep that calls ``initialize_model_parallel`` once per layout and
seed builds a few dozen groups each time, and a world that runs several sweeps ends with
thousands of threads on two cores. Production code initializes once per process and never sees
this.

:func:`install` wraps ``torch.distributed.new_group`` so that the n-th request for a given rank
list (with the same backend, timeout and synchronization mode) since the last
``initialize_model_parallel`` gets the same group object as the n-th such request of every
earlier initialization. Within one initialization, two requests for the same ranks still get two
distinct groups (upstream code compares groups by identity, e.g. the expert TP group against the
TP group), so what the code under test sees is what it would see in a fresh process. Every rank
issues the same requests in the same order, so every rank reuses the same groups.
``destroy_process_group`` of a reused group is a no-op: it is kept for the next initialization.
Requests with ``pg_options`` or other arguments the cache does not understand are passed through.
"""

import collections
import functools
import inspect

_KEY_ARGS = ('ranks', 'timeout', 'backend', 'use_local_synchronization')
_PASS_THROUGH_UNLESS_DEFAULT = ('pg_options', 'device_id')


class _State:
    def __init__(self):
        self.groups = collections.defaultdict(list)  # key -> [group, ...] in request order
        self.taken = collections.Counter()  # key -> requests since the last initialization
        self.reused = set()  # ids of the groups in self.groups

    def reset(self):
        self.taken.clear()


STATE = _State()
_UNCACHED = []  # torch.distributed.new_group as it was before install()


def uncached_new_group(*args, **kwargs):
    """A new group that the cache neither hands out again nor keeps: for a group a scenario lets
    time out (gloo closes its pairs then, so a later request for the same ranks and timeout
    must not get it back). Every rank must call it at the same point, as ``new_group``."""
    import torch.distributed as dist

    return (_UNCACHED[0] if _UNCACHED else dist.new_group)(*args, **kwargs)


def _key(bound):
    args = bound.arguments
    for name in _PASS_THROUGH_UNLESS_DEFAULT:
        if args.get(name) is not None:
            return None
    ranks = args.get('ranks')
    key = (
        None if ranks is None else tuple(int(r) for r in ranks),
        args.get('timeout'),
        None if args.get('backend') is None else str(args.get('backend')).lower(),
        bool(args.get('use_local_synchronization', False)),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def install(dist, parallel_state):
    """Wrap ``dist.new_group``, ``dist.destroy_process_group`` and the model-parallel init.

    Args:
        dist: the ``torch.distributed`` module.
        parallel_state: ``megatron.core.parallel_state`` of the tree under test.
    """
    if getattr(dist.new_group, '_fork_group_cache', False):
        return
    new_group = dist.new_group
    _UNCACHED[:] = [new_group]
    destroy = dist.destroy_process_group
    initialize = parallel_state.initialize_model_parallel
    signature = inspect.signature(new_group)

    @functools.wraps(new_group)
    def cached_new_group(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return new_group(*args, **kwargs)
        key = _key(bound)
        if key is None:
            return new_group(*args, **kwargs)
        index = STATE.taken[key]
        STATE.taken[key] += 1
        pool = STATE.groups[key]
        if index < len(pool):
            return pool[index]
        group = new_group(*args, **kwargs)
        pool.append(group)
        STATE.reused.add(id(group))
        return group

    @functools.wraps(destroy)
    def keep_reused_groups(group=None, *args, **kwargs):
        if group is not None and id(group) in STATE.reused:
            return None
        return destroy(group, *args, **kwargs)

    @functools.wraps(initialize)
    def initialize_with_fresh_slots(*args, **kwargs):
        STATE.reset()
        return initialize(*args, **kwargs)

    cached_new_group._fork_group_cache = True
    dist.new_group = cached_new_group
    dist.destroy_process_group = keep_reused_groups
    parallel_state.initialize_model_parallel = initialize_with_fresh_slots
