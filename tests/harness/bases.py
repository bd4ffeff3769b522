"""Which upstream base the suite runs on, and what that base already contains.

The base is ``FORK_TEST_BASE`` (a maintained base of patches/upstream.toml: 0.19.2, 0.18.2, or dev
with ``FORK_TEST_DEV_REPO`` naming a Megatron-LM checkout); default: the pin's ``default`` (the
newest release). Test modules use the labels below; the launcher maps them onto the selected
base's trees:

- ``FORK`` ('fork'): upstream BASE + ``patches/BASE/series``. That is the repository's
  ``megatron/`` when it was materialized from BASE (so edits in progress are tested), else
  ``build/trees/fork-BASE`` (rebuilt when the series changes).
- ``PRISTINE`` ('pristine-BASE'): upstream BASE without patches.

Where a base already contains a fix upstream (0005/0006 in 0.19.2), pristine and fork agree
there; :func:`upstream_has` reads that from ``patches/changes.toml`` so a counterfactual test can
assert agreement instead of a failure.
"""

import os
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The repository's own tool (not an installed copy) reads the pin, the series and the workspace.
if os.path.join(REPO, 'tools') not in sys.path:
    sys.path.insert(0, os.path.join(REPO, 'tools'))

from megatron_fork import records as _records  # noqa: E402  pylint: disable=wrong-import-position
from megatron_fork import series as _series  # noqa: E402  pylint: disable=C0413
from megatron_fork import upstream as _upstream  # noqa: E402  pylint: disable=C0413
from megatron_fork.workspace import Workspace  # noqa: E402  pylint: disable=C0413

# The repository's megatron/, .pq/, patches/ and build/; WORKSPACE.base() is the base megatron/
# was materialized from (None if none).
WORKSPACE = Workspace(Path(REPO))
PATCHES = str(WORKSPACE.patch_root)
PIN = _upstream.load_pin(WORKSPACE.pin_file)
CHANGES = _records.load(WORKSPACE.patch_root)
DEV_REPO = os.environ.get('FORK_TEST_DEV_REPO') or None
BASE = os.environ.get('FORK_TEST_BASE') or PIN['default']
if BASE not in PIN['maintained']:
    raise RuntimeError(
        f"FORK_TEST_BASE={BASE!r} is not a maintained base ({', '.join(PIN['maintained'])})"
    )
FORK = 'fork'
PRISTINE = f'pristine-{BASE}'
RELEASES = _upstream.releases(PIN)


def upstream_has(change, base=None):
    """True when upstream ``base`` (default: the selected one) already contains ``change``.

    Args:
        change: a change slug of patches/changes.toml (the patches' ``Fork-Change:`` trailer),
            e.g. 'expert-grad-stats'.
        base: a maintained base name.
    """
    if change not in CHANGES:
        raise KeyError(f'unknown change {change!r}; known: {", ".join(CHANGES)}')
    return _records.upstream_record(CHANGES, change, base or BASE) is not None


def carries(change, base=None):
    """True when the fork's series of ``base`` (default: the selected one) carries ``change``."""
    return change_state(change, base) == 'carried'


def change_state(change, base=None):
    """'carried', 'upstream' or None (``base``, default the selected one, cannot take it)."""
    record = CHANGES.get(change)
    state = record.bases.get(base or BASE) if record is not None else None
    return 'upstream' if isinstance(state, dict) else state


def tree_has_fix(tree, change, base=None):
    """True when ``tree`` has ``change``'s fix: upstream on the base, or carried and the fork."""
    state = change_state(change, base)
    return state == 'upstream' or (state == 'carried' and tree == FORK)


def series_entries(base):
    """The entries of ``patches/<base>/series``, in order (``fork/0001-x.patch``, ...)."""
    return _series.read_series(WORKSPACE.patch_dir(base))


def upstream_ref(base=None):
    """The Megatron-LM git ref of ``base`` (default: the selected one): commit, tag or nearest ref.

    Used to read upstream files that the wheels do not ship (``pretrain_gpt.py``) at the version
    that matches the base.
    """
    pin = PIN['bases'][base or BASE]
    return pin.get('commit') or pin.get('git_tag') or pin['nearest_ref']


def source_args(base):
    """Extra tools/fork.py arguments to obtain ``base`` (the checkout for a git base)."""
    if not _upstream.is_git_base(PIN, base):
        return []
    if not DEV_REPO:
        raise RuntimeError(
            f'base {base} is a Megatron-LM commit: set FORK_TEST_DEV_REPO to a checkout'
        )
    return ['--git-repo', DEV_REPO]
