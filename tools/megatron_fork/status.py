"""The status matrix: every change of the fork against every base or ref.

Columns are pinned bases (``--base``: wheels by hash, dev from a checkout) and any git ref
(``--rev`` with ``--git-repo``). Each column is tried with a series: its own when the base is
maintained, else the series its pin entry names (refs: ``--series``, default the primary). A
cell is clean / offset / fuzz / CONFLICT (dry runs of GNU patch with the series applied
cumulatively) or upstream: reverse-applies, its upstream commit's hunks reverse-apply (with a
checkout), or recorded in ``patches/changes.toml`` for that base. The record makes the answer for
a wheel base the same with and without a checkout.
"""

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import records as records_mod
from . import series as series_mod
from .series import CLEAN, CONFLICT, FUZZ, OFFSET, UPSTREAM, classify, gnu_patch
from .upstream import extract_git, is_git_base, obtain_tree, resolve_rev, series_base

DEFAULT_BASES = ("0.17.1", "0.18.2", "0.19.2", "dev")

SYMBOL = {
    CLEAN: "clean",
    OFFSET: "offset",
    FUZZ: "fuzz",
    CONFLICT: "CONFLICT",
    UPSTREAM: "upstream",
}


def contains_upstream_commit(patch, tree, git_repo):
    """Check whether ``tree`` already holds the upstream commits a patch names.

    A backport written in the fork's own words cannot reverse-apply on a release that merged
    upstream's version. Its ``Origin: upstream`` trailers name upstream's commits; this reverse-
    applies each commit's hunks to the files the patch touches. The trailer only says where to
    look: the verdict comes from the tree's content.

    Returns:
        A detail string when every named commit reverse-applies, else None.
    """
    if not git_repo or not patch.upstream_commits:
        return None
    verified = []
    for sha in patch.upstream_commits:
        diff = subprocess.run(
            ["git", "-C", str(git_repo), "show", "--format=", sha, "--", *patch.files],
            capture_output=True,
        )
        if diff.returncode != 0 or not diff.stdout.strip():
            return None
        with tempfile.NamedTemporaryFile(suffix=".diff") as f:
            f.write(diff.stdout)
            f.flush()
            rc, _ = gnu_patch(f.name, tree, reverse=True, fuzz=2)
        if rc != 0:
            return None
        verified.append(sha[:10])
    return "contains upstream commit " + ", ".join(verified) + " (its hunks reverse-apply)"


def evaluate(patches, tree, git_repo=None):
    """Classify each patch against ``tree``, applying the series cumulatively as it goes.

    A patch found already upstream is not applied; one that applies (with offset or fuzz) is
    applied so that later patches see it; a conflicting one is skipped.

    Args:
        patches: the series.
        tree: a scratch copy of the base (modified in place).
        git_repo: a Megatron-LM clone, to verify ``Origin: upstream`` trailers.

    Returns:
        {patch name: (outcome, detail)}
    """
    cells = {}
    for patch in patches:
        outcome, detail = classify(patch, tree)
        if outcome not in (CLEAN, UPSTREAM):
            found = contains_upstream_commit(patch, tree, git_repo)
            if found:
                outcome, detail = UPSTREAM, found
        if outcome in (CLEAN, OFFSET, FUZZ):
            gnu_patch(patch.path, tree, fuzz=3, dry_run=False)
        cells[patch.name] = (outcome, detail)
    return cells


def _is_ancestor(git_repo, commit, rev):
    proc = subprocess.run(
        ["git", "-C", str(git_repo), "merge-base", "--is-ancestor", commit, rev],
        capture_output=True,
    )
    return proc.returncode == 0


@dataclass
class Column:
    """One column of the matrix: a pinned base or a git ref, and the series tried on it."""

    label: str
    base: str  # the pinned base name, or the ref for --rev
    series: str  # the maintained base whose series is tried
    rev: str = None  # git revision (git bases and refs)
    cells: dict = field(default_factory=dict)  # row key -> (outcome, detail)
    am3: dict = None  # patch name -> git am -3 result


def _row_key(patch):
    return patch.change or patch.name


@dataclass
class Result:
    """The matrix, the rows (changes) in order, and the columns that could not be checked."""

    rows: list
    columns: list
    patches: dict  # row key -> a representative patch (for metadata)
    skipped: list
    changes: dict

    def render(self):
        """A text table plus the details of every cell that is not clean."""
        width = max([len(r) for r in self.rows] + [6])
        widths = [max(len(c.label), 9) for c in self.columns]
        lines = ["change".ljust(width) + "".join(
            f"  {c.label:>{w}}" for c, w in zip(self.columns, widths))]  # fmt: skip
        for row in self.rows:
            cells = [SYMBOL.get(c.cells.get(row, ("-", ""))[0], "-") for c in self.columns]
            lines.append(row.ljust(width) + "".join(
                f"  {v:>{w}}" for v, w in zip(cells, widths)))  # fmt: skip
        series = ", ".join(f"{c.label}: patches/{c.series}/" for c in self.columns)
        lines += ["", f"series tried: {series}"]
        details = [
            f"  {c.label}: {row}: {c.cells[row][1]}"
            for c in self.columns
            for row in self.rows
            if row in c.cells and c.cells[row][0] != CLEAN and c.cells[row][1]
        ]
        if details:
            lines += ["", "details:"] + details
        for c in self.columns:
            if c.am3 is not None:
                lines += ["", f"git am -3 on {c.label} (patches/{c.series}/):"]
                lines += [f"  {name}: {res}" for name, res in c.am3.items()]
        return "\n".join(lines)

    def metadata_warnings(self):
        """Cells that contradict the change records or a patch's trailers."""
        warnings = []
        for c in self.columns:
            for row, (outcome, detail) in c.cells.items():
                recorded = records_mod.upstream_record(self.changes, row, c.base)
                if outcome == UPSTREAM and not recorded and c.base == c.series:
                    warnings.append(
                        f"{row}: found upstream in {c.label} ({detail}) but patches/{c.series}/ "
                        "carries it: drop it there and record it in patches/changes.toml"
                    )
                patch = self.patches.get(row)
                if (
                    outcome == UPSTREAM
                    and patch
                    and not self.changes
                    and not patch.upstream_commits
                    and "Applied-Upstream:"
                    not in patch.path.read_text().split("\ndiff --git", 1)[0]
                ):
                    warnings.append(
                        f"{patch.name}: found upstream in {c.label} but it has neither an Origin "
                        f"nor an Applied-Upstream trailer (Forwarded: {patch.forwarded!r})"
                    )
        return warnings

    def as_json(self):
        """The matrix as JSON-able data."""
        return {
            "rows": self.rows,
            "columns": [
                {
                    "label": c.label,
                    "base": c.base,
                    "series": c.series,
                    "rev": c.rev,
                    "cells": {r: {"outcome": o, "detail": d} for r, (o, d) in c.cells.items()},
                    "am3": c.am3,
                }
                for c in self.columns
            ],
            "skipped": self.skipped,
        }


def status(pin, ws, names, revs=(), git_repo=None, am3=False, source=None, ref_series=None):
    """Compute the matrix.

    Args:
        pin: the loaded pin.
        ws: the workspace whose ``patches/`` holds the series and the change catalogue.
        names: pinned bases (columns).
        revs: git refs of ``git_repo`` (columns).
        git_repo: a Megatron-LM clone (git bases, refs, upstream-commit checks, ``am3``).
        am3: also run ``git am -3`` of the column's series on every git column.
        source: wheel source options (wheel_dir, offline).
        ref_series: the series tried on refs (default: the primary base).

    Returns:
        A :class:`Result`.
    """
    changes = records_mod.load(ws.patch_root)
    columns, skipped = _columns(pin, names, revs, git_repo, ref_series)
    reps = {}
    for column in columns:
        patches = series_mod.load_series(ws.patch_dir(column.series))
        for patch in patches:
            reps.setdefault(_row_key(patch), patch)
        _fill_patch_cells(pin, column, patches, changes, git_repo, source)
        _fill_change_cells(column, changes, git_repo)
        if am3 and column.rev:
            column.am3 = am3_check(patches, git_repo, column.rev)
    order = {slug: c.number for slug, c in changes.items()}
    rows = []
    for column in columns:
        for row in column.cells:
            if row not in rows:
                rows.append(row)
    rows.sort(key=lambda r: (order.get(r, 10**6), r))
    return Result(rows, columns, reps, skipped, changes)


def _columns(pin, names, revs, git_repo, ref_series):
    """The matrix's columns (pinned bases, then refs) and the names skipped without a clone."""
    columns, skipped = [], []
    for name in names:
        if is_git_base(pin, name):
            if not git_repo:
                skipped.append(name)
                continue
            commit = pin["bases"][name]["commit"]
            columns.append(Column(f"{name}@{commit[:8]}", name, series_base(pin, name), commit))
        else:
            columns.append(Column(name, name, series_base(pin, name)))
    for rev in revs:
        if not git_repo:
            skipped.append(rev)
            continue
        sha = resolve_rev(git_repo, rev)
        label = rev if rev.startswith(sha[:7]) else f"{rev}@{sha[:8]}"
        columns.append(Column(label, rev, ref_series or pin["primary"], sha))
    return columns, skipped


def _fill_patch_cells(pin, column, patches, changes, git_repo, source):
    """One cell per patch of the column's series: recorded upstream, or how it applies there."""
    tmp = Path(tempfile.mkdtemp(prefix="fork-status-"))
    try:
        if column.rev:
            extract_git(git_repo, column.rev, tmp)
        else:
            obtain_tree(pin, column.base, tmp, **(source or {}))
        carried = [
            p for p in patches
            if not records_mod.upstream_record(changes, p.change, column.base)
        ]  # fmt: skip
        by_name = evaluate(carried, tmp, git_repo)
        for patch in patches:
            record = records_mod.upstream_record(changes, patch.change, column.base)
            if record:
                detail = "recorded in changes.toml: " + records_mod.describe_upstream(record)
                column.cells[_row_key(patch)] = (UPSTREAM, detail)
            else:
                column.cells[_row_key(patch)] = by_name[patch.name]
            change = changes.get(patch.change)
            commit = change.upstream_commit if change is not None else None
            outcome = column.cells[_row_key(patch)][0]
            if (
                outcome == CONFLICT
                and column.rev
                and commit
                and _is_ancestor(git_repo, commit, column.rev)
            ):
                # Upstream's own version was merged and has moved on since, so neither the
                # backport nor upstream's hunks reverse-apply; the history says it is there.
                detail = f"upstream commit {commit[:10]} is an ancestor of {column.label}"
                column.cells[_row_key(patch)] = (UPSTREAM, detail)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fill_change_cells(column, changes, git_repo):
    """Changes the column's series does not carry: upstream there (recorded or by history)."""
    for slug, entry in changes.items():
        if slug in column.cells:
            continue
        record = records_mod.upstream_record(changes, slug, column.base)
        commit = entry.upstream_commit
        if record:
            detail = "recorded in changes.toml: " + records_mod.describe_upstream(record)
            column.cells[slug] = (UPSTREAM, detail)
        elif column.rev and commit and _is_ancestor(git_repo, commit, column.rev):
            detail = f"upstream commit {commit[:10]} is an ancestor of {column.label}"
            column.cells[slug] = (UPSTREAM, detail)


def am3_check(patches, git_repo, commit):
    """Apply the series with ``git am -3`` on ``commit`` of a local Megatron-LM clone.

    Returns:
        {patch name: "ok" | "already applied" | "FAILED: ..."}
    """
    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="fork-am3-"))
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", "-C", str(tmp / "wt"), *a], capture_output=True, text=True
        )
        subprocess.run(
            ["git", "clone", "-q", "--shared", "--no-checkout", str(git_repo), str(tmp / "wt")],
            check=True,
        )
        run("checkout", "-q", "--detach", commit)
        for patch in patches:
            before = run("rev-parse", "HEAD").stdout.strip()
            proc = run(
                "-c", "user.name=fork", "-c", "user.email=fork@invalid", "am", "-3", "-q",
                str(patch.path),
            )  # fmt: skip
            if proc.returncode != 0:
                text = (proc.stdout + proc.stderr).strip()
                if "No changes" in text or "Patch already applied" in text:
                    results[patch.name] = "already applied"
                else:
                    results[patch.name] = "FAILED: " + text.splitlines()[0] if text else "FAILED"
                run("am", "--abort")
            elif run("rev-parse", "HEAD").stdout.strip() == before:
                results[patch.name] = "already applied"
            else:
                results[patch.name] = "ok"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results
