"""Batching of scenario calls: every call registered for a (world_size, tree) runs in ONE world.

Test modules register calls at import (collection) time; the first test that needs a result runs
the whole batch for its (world_size, tree) and every later test reads the cached results.

    from tests.harness import call

    TRAIN = call(2, 'pristine-0.18.2', 'tests.scenarios.ddp_training:scenario_train', steps=3)

    def test_train():
        per_rank = TRAIN.result()      # list of per-rank dicts (skips under nccl if too few GPUs)
"""

import json
import os
import threading

from tests.harness import launcher, tiers

_LOCK = threading.Lock()
_PENDING = {}  # (world_size, tree) -> [Call] not yet run
_BATCH_TIMEOUT = {}  # (world_size, tree) -> extra seconds requested by callers
_BY_KEY = {}  # (world_size, tree, target, kwargs as JSON) -> the first Call registered for it


class Call:
    """A registered scenario call; ``result()`` returns its per-rank results."""

    def __init__(self, world_size, tree, target, kwargs, timeout):
        self.world_size = world_size
        self.tree = tree
        self.target = target
        self.kwargs = kwargs
        self.timeout = timeout
        self._result = None
        self._error = None

    def __repr__(self):
        return f'Call({self.world_size}, {self.tree!r}, {self.target!r}, {self.kwargs!r})'

    def result(self):
        """Per-rank results of this call, running its (world_size, tree) batch if needed.

        Raises pytest.skip under FORK_TEST_BACKEND=nccl when there are fewer GPUs than ranks;
        re-raises the HarnessError of a failed batch for every call in it.
        """
        if self._result is None and self._error is None:
            skip = skip_reason(self.world_size)
            if skip:
                import pytest

                pytest.skip(skip)
            _run_batch((self.world_size, self.tree), self)
        if self._error is not None:
            raise self._error
        return self._result

    def errors(self):
        """The per-rank error strings (None for ranks that returned normally)."""
        return [r.get('error') if isinstance(r, dict) else None for r in self.result()]


def skip_reason(world_size):
    """Why a world of this size cannot run here (None if it can)."""
    if launcher.backend() == 'nccl':
        n = launcher.gpu_count()
        if world_size > n:
            return tiers.reason('nccl', f'world_size {world_size} > {n} visible GPUs')
    return None


def canonical_tree(tree):
    """'fork' and 'pristine' name the selected base's trees: 'fork-<BASE>', 'pristine-<BASE>'.

    So a call for 'fork' and one for 'fork-<BASE>' share one world.
    """
    from tests.harness import bases  # pylint: disable=import-outside-toplevel

    if tree in ('fork', 'pristine'):
        return f'{tree}-{bases.BASE}'
    return tree


def call(world_size, tree, target, timeout=None, reuse=False, **kwargs):
    """Register ``target(ctx, **kwargs)`` to run in the shared (world_size, tree) world.

    Args:
        world_size: ranks.
        tree: 'fork', 'pristine', 'fork-<base>', 'pristine-<base>' or an absolute path.
        target: "tests.scenarios.module:function".
        timeout: extra seconds this call may need on top of the per-call default.
        reuse: return the Call registered earlier with the same world, tree, target and kwargs
            (if any) instead of running the scenario again; for readers of results that another
            module already asks for (the README's demo table).
        **kwargs: JSON-able keyword arguments for the scenario.

    Returns:
        Call: use ``.result()`` inside the test.
    """
    tree = canonical_tree(tree)
    key = (world_size, tree, target, json.dumps(kwargs, sort_keys=True))
    with _LOCK:
        if reuse and key in _BY_KEY:
            return _BY_KEY[key]
        c = Call(world_size, tree, target, kwargs, timeout)
        _BY_KEY.setdefault(key, c)
        _PENDING.setdefault((world_size, tree), []).append(c)
    return c


def world_results(world_size, tree, calls, timeout=None):
    """Register ``calls`` [(target, kwargs), ...] and return their per-call, per-rank results.

    Calls registered earlier for the same (world_size, tree) run in the same launch.
    """
    handles = [
        call(world_size, tree, target, timeout=timeout, **dict(kw or {})) for target, kw in calls
    ]
    return [h.result() for h in handles]


def _run_batch(key, requester):
    with _LOCK:
        batch = _PENDING.pop(key, [])
    if requester not in batch and requester._result is None and requester._error is None:
        batch.append(requester)
    if not batch:
        return
    extra = sum(c.timeout or 0 for c in batch)
    timeout = launcher.default_timeout(len(batch)) + extra
    if os.environ.get('FORK_TEST_VERBOSE'):
        print(f'[harness] world {key}: {len(batch)} calls')
    try:
        results = launcher.run_world(
            key[0], key[1], [(c.target, c.kwargs) for c in batch], timeout=timeout
        )
    except launcher.HarnessError as exc:
        for c in batch:
            c._error = exc
        return
    for c, res in zip(batch, results):
        c._result = res


def pending():
    """{(world_size, tree): number of registered calls not yet run} (for diagnostics)."""
    with _LOCK:
        return {k: len(v) for k, v in _PENDING.items()}
