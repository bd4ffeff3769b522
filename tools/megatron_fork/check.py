"""``check``: a base's series is consistent, applies with zero fuzz/offset, exports idempotently.

Nothing here touches the developer's ``megatron/``: the series is applied in a private workspace.
"""

import tempfile
from pathlib import Path

from . import EXIT_FAILED, ForkError
from . import queue as queue_mod
from . import records as records_mod
from . import series as series_mod
from . import sources as sources_mod

MAX_MESSAGE_LINES = 40


def message_lines(path):
    """Lines of a patch's message: from ``Subject:`` to the line before the ``---`` that starts
    the diffstat (or before the first ``diff --git``), trailers included."""
    lines = Path(path).read_text().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("Subject: "))
    ends = (i for i, line in enumerate(lines) if line == "---" or line.startswith("diff --git "))
    return next(ends, len(lines)) - start


def metadata_failures(base, patch_dir, changes):
    """Return the problems of a base's series that need no upstream tree.

    Args:
        base: the base name.
        patch_dir: its series directory.
        changes: the change catalogue (``patches/changes.toml``), possibly empty.
    """
    failures = []
    missing, extra = series_mod.series_mismatch(patch_dir)
    rel = Path(patch_dir).name
    failures += [f"patches/{rel}/series lists {n}, which does not exist" for n in missing]
    failures += [f"patches/{rel}/{n} is not listed in patches/{rel}/series" for n in extra]
    if missing:
        return failures
    patches = series_mod.load_series(patch_dir)
    seen = []
    for patch in patches:
        for req in patch.requires:
            if req not in seen and not records_mod.upstream_record(changes, req, base):
                failures.append(
                    f"{patch.name} requires {req}, which is neither earlier in the series nor "
                    f"upstream in {base}"
                )
        seen.append(patch.change)
        if not patch.forwarded:
            failures.append(f"{patch.name} has no Forwarded trailer")
        length = message_lines(patch.path)
        if length > MAX_MESSAGE_LINES:
            failures.append(f"{patch.where}: message is {length} lines, over {MAX_MESSAGE_LINES}")
        group = patch.name.split("/")[0] if "/" in patch.name else None
        if changes:
            entry = changes.get(patch.change)
            if not patch.change or entry is None:
                failures.append(
                    f"{patch.name}: Fork-Change trailer {patch.change!r} is not a change in "
                    f"patches/{records_mod.CHANGES_FILE}"
                )
                continue
            state = entry.bases.get(base)
            if state != "carried":
                failures.append(
                    f"{patch.name}: change {patch.change} is {state!r} for {base} in "
                    f"{records_mod.CHANGES_FILE}, but the series carries it"
                )
            if group and group != entry.group:
                failures.append(
                    f"{patch.name}: change {patch.change} belongs in group {entry.group}/"
                )
    carried = {p.change for p in patches}
    for slug, entry in changes.items():
        if entry.bases.get(base) == "carried" and slug not in carried:
            failures.append(f"change {slug} is carried on {base} but no patch names it")
    return failures


def check_metadata(pin, base, ws):
    """Raise ForkError (exit 1) naming every problem of ``base``'s series that needs no upstream
    tree: series vs files, trailers, message length, change records, source files, and every
    file generated from the records (docs/changes.md, the README's count, trailers) that
    disagrees with them.

    Args:
        pin: the loaded pin.
        base: a maintained base.
        ws: the workspace whose ``patches/`` is checked.
    """
    patch_dir = ws.patch_dir(base)
    changes = records_mod.load(ws.patch_root)
    failures = metadata_failures(base, patch_dir, changes)
    failures += [
        line
        for line in sources_mod.drift(ws.root, ws.patch_root)
        if line.startswith(f"patches/{base}/")
    ]
    failures += [
        f"{path} disagrees with patches/{records_mod.CHANGES_FILE} (run `tools/fork.py records "
        "--write`)"
        for path in records_mod.plan(ws.patch_root, pin).drift()
        if path.startswith(f"patches/{base}/") or not path.startswith("patches/")
    ]
    if failures:
        raise ForkError(f"check {base} failed:\n  " + "\n  ".join(failures), EXIT_FAILED)
    return changes


def check_base(pin, base, ws, source=None):
    """Check base ``base``; return a one-line summary or raise ForkError (exit 1 or 5).

    Args:
        pin: the loaded pin.
        base: a maintained base.
        ws: the workspace whose ``patches/`` is checked.
        source: forwarded to :func:`upstream.obtain_tree`.
    """
    patch_dir = ws.patch_dir(base)
    changes = check_metadata(pin, base, ws)
    with tempfile.TemporaryDirectory(prefix="fork-check-") as tmp:
        private = queue_mod.Workspace(Path(tmp), patch_root=ws.patch_root)
        queue_mod.materialize(pin, base, ws=private, force=True, **(source or {}))
        rendered = queue_mod.render_patches(private)
    drift = [n for n, t in rendered.items() if (patch_dir / n).read_text() != t]
    if list(rendered) != series_mod.read_series(patch_dir):
        drift.append("series")
    if drift:
        raise ForkError(
            f"check {base} failed: export is not idempotent for "
            + ", ".join(drift)
            + " (run materialize + export and commit the result)",
            EXIT_FAILED,
        )
    upstream = [
        slug for slug in changes if records_mod.upstream_record(changes, slug, base) is not None
    ]
    note = f"; upstream: {', '.join(upstream)}" if upstream else ""
    return (
        f"check {base}: OK ({len(rendered)} patches apply with zero fuzz/offset; export "
        f"idempotent{note})"
    )
