"""The materialized tree (megatron/) as a patch queue: one git commit per patch in .pq/.

``materialize`` builds upstream + series in a temporary directory and swaps it in only when every
patch applied. ``export`` turns the queue's commits back into patches/, deterministically.
"""

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import EXIT_APPLY, EXIT_DIRTY, EXIT_USAGE, ForkError
from .series import CLEAN, PATCH_DIR, classify, load_series
from .upstream import REPO, obtain_tree

TREE = REPO / "megatron"
PQ = REPO / ".pq"
BUILD = REPO / "build"
NAMES_FILE = "fork-patch-names"  # inside the queue's git dir: subject -> patch file name

# Fixed identity and configuration so that materialize and export never depend on the user's git.
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_COMMITTER_NAME": "megatron-fork",
    "GIT_COMMITTER_EMAIL": "megatron-fork@users.noreply.github.com",
    "GIT_AUTHOR_NAME": "megatron-fork",
    "GIT_AUTHOR_EMAIL": "megatron-fork@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
}
EXPORT_OPTS = [
    "-c", "diff.algorithm=myers", "-c", "diff.renames=true", "-c", "core.quotePath=true",
    "-c", "format.signature=", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
]  # fmt: skip


def git(work_tree, git_dir, *args, check=True, env=None, **kwargs):
    """Run git on a queue (``git_dir``) whose work tree is ``work_tree``; return stdout."""
    full_env = {**os.environ, **GIT_ENV, **(env or {})}
    cmd = ["git", f"--git-dir={git_dir}", f"--work-tree={work_tree}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, **kwargs)
    if check and proc.returncode != 0:
        raise ForkError(f"git {' '.join(args[:3])} failed: {proc.stderr.strip()}", EXIT_USAGE)
    return proc.stdout


def pq(*args, **kwargs):
    """Run git on the repository's queue (.pq, work tree = repo root, megatron/ only)."""
    return git(REPO, PQ, *args, **kwargs)


PY_CACHE = (":(exclude,glob)**/__pycache__/**", ":(exclude,glob)**/*.pyc")


def _dirty():
    """Return the edits in megatron/ not yet in a queue commit (tracked and new files).

    The repository's .gitignore ignores megatron/ as a whole, so new files are listed without
    ignore rules, minus Python caches.
    """
    changed = pq("status", "--porcelain", "--untracked-files=no", "--", "megatron").splitlines()
    new = pq("ls-files", "--others", "--", "megatron", *PY_CACHE).splitlines()
    return "\n".join(changed + [f"?? {path}" for path in new])


APPLIED_FILE = "fork-applied"  # inside the queue's git dir: the patch texts materialize applied


def queue_state():
    """Describe work in megatron/ that exists nowhere else: uncommitted edits or unexported commits.

    A tree that merely lags behind patches/ (say, after a git pull) holds no such work.

    Returns:
        A list of human-readable problems; empty when nothing would be lost by re-materializing.
    """
    if not TREE.exists():
        return []
    if not PQ.exists():
        return ["megatron/ exists but .pq/ does not: it was not made by materialize"]
    problems = []
    dirty = _dirty()
    if dirty:
        problems.append("uncommitted edits in megatron/:\n" + dirty)
    applied = PQ / APPLIED_FILE
    recorded = applied.read_text() if applied.is_file() else None
    if _fingerprint(render_patches()) != recorded:
        problems.append("the queue has commits that are not exported to patches/")
    return problems


def is_current():
    """True when megatron/ was materialized from exactly the current patches/ and is unedited."""
    if not TREE.exists() or not PQ.exists() or queue_state():
        return False
    current = {p.name: p.path.read_text() for p in load_series()}
    return _fingerprint(current) == (PQ / APPLIED_FILE).read_text()


def _fingerprint(rendered):
    return "".join(
        f"{hashlib.sha256(text.encode()).hexdigest()}  {name}\n" for name, text in rendered.items()
    )


def materialize(pin, base_name, force=False, dest_tree=None, interrupt_after=None, **source):
    """Build upstream + series and swap it into megatron/ (or ``dest_tree``) atomically.

    Args:
        pin: the loaded pin.
        base_name: the base to build on.
        force: discard unsaved work in megatron/ (otherwise refuse, exit 6).
        dest_tree: build a pristine tree (no series, no queue) at this directory instead.
        interrupt_after: test hook: raise KeyboardInterrupt after this many patches.
        **source: forwarded to :func:`upstream.obtain_tree` (wheel, wheel_dir, offline, ...).

    Returns:
        The list of applied patch names.
    """
    if dest_tree is None and not force:
        problems = queue_state()
        if problems:
            raise ForkError(
                "megatron/ holds work that would be lost; run `tools/fork.py export` first "
                "(or pass --force):\n  " + "\n  ".join(problems),
                EXIT_DIRTY,
            )
    patches = [] if dest_tree is not None else load_series()
    BUILD.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".materialize-", dir=BUILD))
    try:
        origin = obtain_tree(pin, base_name, tmp, **source)
        if dest_tree is not None:
            _swap(tmp / "megatron", Path(dest_tree) / "megatron")
            return []
        git_dir = tmp / ".pq"
        git(tmp, git_dir, "init", "-q")
        git(tmp, git_dir, "add", "-A", "-f", "--", "megatron", *PY_CACHE)
        git(tmp, git_dir, "commit", "-q", "-m", f"upstream: megatron-core {base_name}\n\n{origin}")
        git(tmp, git_dir, "tag", "base")
        names = {}
        for count, patch in enumerate(patches):
            if interrupt_after is not None and count == interrupt_after:
                raise KeyboardInterrupt(f"test interrupt after {count} patches")
            outcome, detail = classify(patch, tmp)
            if outcome != CLEAN:
                raise ForkError(
                    f"patch {patch.name} does not apply with zero fuzz and offset to "
                    f"megatron-core {base_name} ({outcome}): {detail}",
                    EXIT_APPLY,
                )
            git(tmp, git_dir, "am", "-q", "--no-3way", "--keep-cr", str(patch.path))
            names[git(tmp, git_dir, "log", "-1", "--format=%s").strip()] = patch.name
        (git_dir / NAMES_FILE).write_text("".join(f"{s}\t{n}\n" for s, n in names.items()))
        (git_dir / APPLIED_FILE).write_text(
            _fingerprint({p.name: p.path.read_text() for p in patches})
        )
        git(tmp, git_dir, "config", "core.worktree", str(REPO))
        git(tmp, git_dir, "config", "status.showUntrackedFiles", "no")
        _swap(tmp / "megatron", TREE, tmp / ".pq", PQ)
        return [p.name for p in patches]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap(new_tree, old_tree, new_git=None, old_git=None):
    """Replace old_tree (and old_git) by the new ones; on any failure put the old ones back."""
    pairs = [(Path(new_tree), Path(old_tree))]
    if new_git is not None:
        pairs.append((Path(new_git), Path(old_git)))
    stash = Path(tempfile.mkdtemp(prefix=".previous-", dir=BUILD))
    moved, placed = [], []
    try:
        for i, (_, old) in enumerate(pairs):
            if old.exists():
                os.rename(old, stash / str(i))
                moved.append((stash / str(i), old))
        for new, old in pairs:
            old.parent.mkdir(parents=True, exist_ok=True)
            os.rename(new, old)
            placed.append(old)
    except BaseException:
        for old in placed:
            shutil.rmtree(old, ignore_errors=True)
        for saved, old in moved:
            os.rename(saved, old)
        raise
    finally:
        shutil.rmtree(stash, ignore_errors=True)


def _known_names():
    path = PQ / NAMES_FILE
    if not path.is_file():
        return {}
    return dict(line.split("\t", 1) for line in path.read_text().splitlines() if "\t" in line)


def _slug(subject):
    return re.sub(r"[^A-Za-z0-9_.]+", "-", subject).strip("-.")[:52].rstrip("-.")


def render_patches():
    """Return {file name: patch text} for every queue commit after the base, in order."""
    commits = pq("rev-list", "--reverse", "base..HEAD").split()
    known = _known_names()
    rendered = {}
    for index, sha in enumerate(commits, 1):
        subject = pq("log", "-1", "--format=%s", sha).strip()
        name = known.get(subject) or f"{index:04d}-{_slug(subject)}.patch"
        if name in rendered:
            raise ForkError(f"two queue commits export to {name}; give them distinct subjects")
        rendered[name] = pq(
            *EXPORT_OPTS, "format-patch", "--stdout", "--full-index", "--zero-commit",
            "--no-signature", "--no-numbered", "--subject-prefix=PATCH", "-1", sha,
        )  # fmt: skip
    return rendered


def export():
    """Write the queue's commits to patches/ and patches/series; return (written, removed)."""
    if not PQ.exists():
        raise ForkError("no patch queue: run `tools/fork.py materialize` first", EXIT_USAGE)
    dirty = _dirty()
    if dirty:
        raise ForkError(
            "megatron/ has edits that are not in a queue commit; commit them with "
            "`tools/fork.py commit --to PATCH` or `tools/fork.py commit --new SUBJECT`:\n" + dirty,
            EXIT_DIRTY,
        )
    rendered = render_patches()
    applied = PQ / APPLIED_FILE
    ours = (
        {line.split("  ", 1)[1] for line in applied.read_text().splitlines()}
        if applied.is_file()
        else set()
    )
    strangers = [
        p.name for p in PATCH_DIR.glob("*.patch") if p.name not in rendered and p.name not in ours
    ]
    if strangers:
        raise ForkError(
            "patches/ holds files that the queue never applied: "
            + ", ".join(sorted(strangers))
            + "; list them in patches/series and run materialize (or move them away) before "
            "exporting, so that nothing is deleted by accident",
            EXIT_DIRTY,
        )
    written = []
    for name, text in rendered.items():
        path = PATCH_DIR / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(name)
    removed = []
    for path in PATCH_DIR.glob("*.patch"):
        if path.name not in rendered:
            path.unlink()
            removed.append(path.name)
    series = "".join(f"{name}\n" for name in rendered)
    series_path = PATCH_DIR / "series"
    if not series_path.is_file() or series_path.read_text() != series:
        series_path.write_text(series)
        written.append("series")
    names = {pq("log", "-1", "--format=%s", sha).strip(): name for sha, name in zip(
        pq("rev-list", "--reverse", "base..HEAD").split(), rendered)}  # fmt: skip
    (PQ / NAMES_FILE).write_text("".join(f"{s}\t{n}\n" for s, n in names.items()))
    (PQ / APPLIED_FILE).write_text(_fingerprint(rendered))
    return written, removed


def commit(to=None, new=None, message_file=None):
    """Record the edits in megatron/ into the queue.

    Args:
        to: fold the edits into the commit of this patch file name (fixup + autosquash).
        new: create a new patch with this subject at the end of the series.
        message_file: the body of the new patch's message (Problem/Cause/Fix/Validation, trailers).
    """
    if bool(to) == bool(new):
        raise ForkError("commit needs exactly one of --to PATCH or --new SUBJECT", EXIT_USAGE)
    pq("add", "-A", "-f", "--", "megatron", *PY_CACHE)
    if new:
        body = Path(message_file).read_text() if message_file else ""
        pq("commit", "-q", "-m", f"{new}\n\n{body}".rstrip() + "\n")
        return
    by_name = {v: k for k, v in _known_names().items()}
    if to not in by_name:
        raise ForkError(f"no queue commit for patch {to}; known: {', '.join(by_name)}", EXIT_USAGE)
    subjects = pq("log", "--format=%H %s", "base..HEAD").splitlines()
    target = next(
        line.split(" ", 1)[0] for line in subjects if line.split(" ", 1)[1] == by_name[to]
    )
    pq("commit", "-q", f"--fixup={target}")
    pq("rebase", "-q", "-i", "--autosquash", "base", env={"GIT_SEQUENCE_EDITOR": "true"})
