"""The status matrix: every patch of the series against every base."""

import shutil
import subprocess
import tempfile
from pathlib import Path

from .series import CLEAN, CONFLICT, FUZZ, OFFSET, UPSTREAM, classify, gnu_patch, load_series
from .upstream import extract_git, obtain_tree

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
    upstream's version. Its ``Upstream-Commit:`` trailers name upstream's commits; this reverse-
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
        git_repo: a Megatron-LM clone, to verify ``Upstream-Commit:`` trailers.

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


def base_trees(pin, names, git_repo=None, source=None):
    """Yield (column label, tree directory) for every requested base; trees are temporary."""
    for name in names:
        tmp = Path(tempfile.mkdtemp(prefix="fork-status-"))
        try:
            if name in pin.get("git_bases", {}):
                if not git_repo:
                    continue
                commit = pin["git_bases"][name]["commit"]
                extract_git(git_repo, commit, tmp)
                yield f"{name}@{commit[:8]}", tmp
            else:
                obtain_tree(pin, name, tmp, **(source or {}))
                yield name, tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


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


def metadata_warnings(patches, matrix):
    """Compare each patch's Upstream-Status trailer with what was detected."""
    warnings = []
    for patch in patches:
        found = [col for col, cells in matrix.items() if cells[patch.name][0] == UPSTREAM]
        says_applied = patch.upstream_status.lower().startswith("applied")
        if found and not says_applied:
            warnings.append(
                f"{patch.name}: found upstream in {', '.join(found)} but its Upstream-Status is "
                f"{patch.upstream_status!r}: drop it from the series for those bases or update it"
            )
        if says_applied and not found:
            warnings.append(
                f"{patch.name}: Upstream-Status says applied, but no checked base contains it"
            )
    return warnings


def render(patches, matrix, am3=None):
    """Render the matrix as a text table plus the non-clean details."""
    cols = list(matrix)
    width = max([len(p.name) for p in patches] + [5])
    lines = ["patch".ljust(width) + "".join(f"  {c:>14}" for c in cols)]
    if am3 is not None:
        lines[0] += "  git am -3 (dev)"
    for patch in patches:
        row = patch.name.ljust(width)
        row += "".join(f"  {SYMBOL[matrix[c][patch.name][0]]:>14}" for c in cols)
        if am3 is not None:
            row += "  " + am3.get(patch.name, "-")
        lines.append(row)
    details = [
        f"  {c}: {p.name}: {matrix[c][p.name][1]}"
        for c in cols
        for p in patches
        if matrix[c][p.name][0] not in (CLEAN,) and matrix[c][p.name][1]
    ]
    if details:
        lines += ["", "details:"] + details
    return "\n".join(lines)


def status(pin, names, git_repo=None, am3=False, source=None):
    """Compute the matrix; return (patches, matrix, am3 results or None)."""
    patches = load_series()
    matrix = {
        label: evaluate(patches, tree, git_repo)
        for label, tree in base_trees(pin, names, git_repo, source)
    }
    am3_results = None
    if am3 and git_repo:
        commit = pin["git_bases"]["dev"]["commit"]
        am3_results = am3_check(patches, git_repo, commit)
    return patches, matrix, am3_results
