"""The evidence branch: where the fork's measurement data lives (docs/evidence.md).

Documents on main cite its files as ``evidence:<folder>/<file>`` (git's ``<rev>:<path>``).
"""

import subprocess

BRANCH = "evidence"


def ref(repo):
    """The evidence branch as the clone at ``repo`` has it (local, else its origin's, else
    fetched from origin once), or None where the clone cannot reach it (a single-branch clone
    without its origin)."""
    for name in (BRANCH, f"origin/{BRANCH}"):
        if _git(repo, "rev-parse", "--verify", "-q", f"{name}^{{commit}}") is not None:
            return name
    if _git(repo, "fetch", "-q", "--depth", "1", "origin", f"{BRANCH}:{BRANCH}") is not None:
        return BRANCH
    return None


def paths(repo):
    """Every file and folder path on the evidence branch, or None (see :func:`ref`)."""
    name = ref(repo)
    if name is None:
        return None
    files = _git(repo, "ls-tree", "-r", "--name-only", name).split()
    return set(files) | {f.rsplit("/", i)[0] for f in files for i in range(1, f.count("/") + 1)}


def _git(repo, *args):
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
