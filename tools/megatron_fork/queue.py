"""The materialized tree (megatron/) as a patch queue: one git commit per patch in .pq/.

``materialize`` builds upstream + a base's series in a temporary directory and swaps it in only
when every patch applied. ``export`` turns the queue's commits back into ``patches/<base>/``,
deterministically. Every location comes from a :class:`Workspace`, never from module globals.
"""

import contextlib
import errno
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import EXIT_APPLY, EXIT_BUSY, EXIT_DIRTY, EXIT_IO, EXIT_USAGE, ForkError, excludes
from . import records as records_mod
from . import sources as sources_mod
from .series import CLEAN, GROUPS, classify, load_series, read_series
from .upstream import obtain_tree
from .workspace import BASE_FILE, Workspace

NAMES_FILE = "fork-patch-names"  # inside the queue's git dir: subject -> series entry
APPLIED_FILE = "fork-applied"  # inside the queue's git dir: the patch texts materialize applied
LOCK_FILE = ".materialize.lock"
LOCK_WAIT_S = float(os.environ.get("MEGATRON_FORK_LOCK_WAIT", 600))
TEMP_PREFIXES = (".materialize-", ".previous-")

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
FORMAT_OPTS = [
    "format-patch", "--stdout", "--full-index", "--zero-commit", "--no-signature",
    "--no-numbered", "--subject-prefix=PATCH",
]  # fmt: skip
PY_CACHE = (":(exclude,glob)**/__pycache__/**", ":(exclude,glob)**/*.pyc")
# What the queue tracks: megatron/ and the upstream-layout regression tests that patches add
# (new files under tests/unit_tests/, e.g. for dev, whose patches are upstream PRs). The
# upstream tree itself brings megatron/ only; tests/unit_tests/ holds just what the series adds.
UNIT_TESTS = "tests/unit_tests"
TRACKED = ("megatron", UNIT_TESTS)


def git(work_tree, git_dir, *args, check=True, env=None, **kwargs):
    """Run git on a queue (``git_dir``) whose work tree is ``work_tree``; return stdout."""
    full_env = {**os.environ, **GIT_ENV, **(env or {})}
    cmd = ["git", f"--git-dir={git_dir}", f"--work-tree={work_tree}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, **kwargs)
    if check and proc.returncode != 0:
        raise ForkError(f"git {' '.join(args[:3])} failed: {proc.stderr.strip()}", EXIT_USAGE)
    return proc.stdout


def pq(ws, *args, **kwargs):
    """Run git on the workspace's queue (work tree = its root, the TRACKED paths only)."""
    return git(ws.root, ws.pq, *args, **kwargs)


def _tracked(ws):
    """The TRACKED paths that exist in the work tree or in the queue's index (for pathspecs)."""
    return [
        path
        for path in TRACKED
        if (ws.root / path).exists() or pq(ws, "ls-files", "--", path, check=False).strip()
    ]


def _dirty(ws):
    """Return the edits in megatron/ (and tests/unit_tests/) not yet in a queue commit or patches/.

    The queue's own status (not the clone's ignore rules, which name upstream's files) lists new
    files, minus Python caches. A source file counts only where it differs
    from what the base's patches create: one that merely lags behind patches/ (after a git pull),
    or that this base does not carry, holds no work.
    """
    paths = _tracked(ws)
    if not paths:
        return ""
    settled = [f":(exclude){path}" for path in _settled_sources(ws)]
    changed = pq(ws, "status", "--porcelain", "--untracked-files=no", "--", *paths, *settled)
    new = pq(ws, "ls-files", "--others", "--", *paths, *PY_CACHE, *settled).splitlines()
    return "\n".join(changed.splitlines() + [f"?? {path}" for path in new])


def _settled_sources(ws):
    """Sources whose bytes on disk are the patches' (or that the materialized base lacks)."""
    base = ws.base()
    carried = {}
    if base is not None and ws.patch_dir(base).is_dir():
        for patch in load_series(ws.patch_dir(base)):
            carried.update(sources_mod.created(patch.path.read_text()))
    settled = []
    for path in sources_mod.paths(ws.patch_root):
        source = ws.root / path
        if path not in carried or (source.is_file() and source.read_text() == carried[path]):
            settled.append(path)
    return settled


def _fold_sources(ws):
    """Fold edited source files into the queue commits that create them."""
    edited = pq(ws, "diff", "--name-only", "HEAD", "--", *sources_mod.paths(ws.patch_root))
    targets = {}
    for path in edited.split():
        sha = pq(ws, "log", "--diff-filter=A", "--format=%H", "base..HEAD", "--", path).split()
        if sha:
            targets.setdefault(sha[-1], []).append(path)
    for sha, paths in targets.items():
        pq(ws, "add", "-f", "--", *paths)
        pq(ws, "commit", "-q", f"--fixup={sha}")
    if targets:
        pq(ws, "rebase", "-q", "-i", "--autosquash", "base", env={"GIT_SEQUENCE_EDITOR": "true"})
    return sorted(p for paths in targets.values() for p in paths)


def _unsourced_files(ws):
    """Files in megatron/ other than the fork's sources (a tree that materialize did not make)."""
    known = set(sources_mod.paths(ws.patch_root))
    return [
        p
        for p in ws.tree.rglob("*")
        if p.is_file()
        and p.relative_to(ws.root).as_posix() not in known
        and "__pycache__" not in p.parts
    ]


def queue_state(ws):
    """Describe work in megatron/ that exists nowhere else: uncommitted edits or unexported commits.

    A tree that merely lags behind patches/ (say, after a git pull) holds no such work.

    Returns:
        A list of human-readable problems; empty when nothing would be lost by re-materializing.
    """
    if not ws.tree.exists():
        return []
    if not ws.pq.exists():
        if not _unsourced_files(ws):
            return []  # a fresh clone: megatron/ holds the fork's source files only
        return ["megatron/ exists but .pq/ does not: it was not made by materialize"]
    problems = []
    dirty = _dirty(ws)
    if dirty:
        problems.append("uncommitted edits in megatron/ or tests/unit_tests/:\n" + dirty)
    applied = ws.pq / APPLIED_FILE
    recorded = applied.read_text() if applied.is_file() else None
    if _fingerprint(render_patches(ws)) != recorded:
        problems.append("the queue has commits that are not exported to patches/")
    return problems


def is_current(ws, base=None):
    """True when megatron/ was materialized from exactly the current series of ``base``, unedited.

    Args:
        ws: the workspace.
        base: the base it must have been built on (default: whichever it was built on).
    """
    if not ws.tree.exists() or not ws.pq.exists() or queue_state(ws):
        return False
    if base is not None and ws.base() != base:
        return False
    current = {p.name: p.path.read_text() for p in load_series(ws.patch_dir())}
    return _fingerprint(current) == (ws.pq / APPLIED_FILE).read_text()


def _fingerprint(rendered):
    return "".join(
        f"{hashlib.sha256(text.encode()).hexdigest()}  {name}\n" for name, text in rendered.items()
    )


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; carries the signal number."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise():
    """Turn SIGTERM (and SIGINT) into :class:`Interrupted` so ``finally`` blocks clean up."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _signals_blocked():
    """Hold SIGINT/SIGTERM during a few renames so the swap is never half done."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def locked(ws, wait_s=None):
    """Hold the workspace's materialize lock; remove temporary folders of killed runs.

    Two runs never interleave: the second waits up to ``wait_s`` (default
    $MEGATRON_FORK_LOCK_WAIT, 600 s) and then fails with exit 7. Under the lock no other run is
    active, so every ``build/.materialize-*`` and ``build/.previous-*`` left is stale.
    """
    import fcntl  # pylint: disable=import-outside-toplevel

    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    try:
        ws.build.mkdir(parents=True, exist_ok=True)
        handle = open(ws.build / LOCK_FILE, "a+")  # pylint: disable=consider-using-with
    except OSError as exc:
        raise io_error(exc, f"cannot create the lock in {ws.build}") from exc
    deadline = time.monotonic() + wait_s
    lock_path = ws.build / LOCK_FILE
    with handle:
        waiting = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                holder = _lock_holder(lock_path)
                if time.monotonic() > deadline:
                    raise ForkError(
                        f"another tools/fork.py run holds {lock_path} ({holder}; waited "
                        f"{wait_s:.0f} s); try again when it has finished",
                        EXIT_BUSY,
                    ) from exc
                if not waiting:
                    print(
                        f"waiting for {lock_path}, held by {holder}: up to {wait_s:.0f} s "
                        "($MEGATRON_FORK_LOCK_WAIT), then exit 7",
                        file=sys.stderr,
                        flush=True,
                    )
                    waiting = True
                time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}: {_command()}\n")
        handle.flush()
        try:
            for stale in ws.build.iterdir():
                if stale.name.startswith(TEMP_PREFIXES):
                    shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)


def _command():
    """This process's command line, as the lock file records it for a waiting run."""
    return " ".join(["tools/fork.py" if a.endswith("fork.py") else a for a in sys.argv])


def _lock_holder(lock_path):
    """What the lock file says about the run that holds it."""
    try:
        text = lock_path.read_text().strip()
    except OSError:
        text = ""
    return text or "a process that did not say which"


IO_HINTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EXDEV: "a rename across file systems (build/ and the tree must be on one)",
    errno.EDQUOT: "disk quota exceeded",
}


def io_error(exc, what):
    """Map an OSError to a one-line :class:`ForkError` with exit code 9 (I/O fault)."""
    hint = IO_HINTS.get(exc.errno, exc.strerror or type(exc).__name__)
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    return ForkError(f"{what}: {hint}{where}; nothing was changed", EXIT_IO)


def materialize(pin, base_name, ws, force=False, dest_tree=None, **source):
    """Build upstream + the base's series and swap it into megatron/ (or ``dest_tree``) atomically.

    Args:
        pin: the loaded pin.
        base_name: the base to build on; its series is ``patches/<base_name>/series``.
        ws: the workspace (tree, queue, patches, build directory).
        force: discard unsaved work in megatron/ (otherwise refuse, exit 6).
        dest_tree: build a tree without a queue at this directory instead: pristine upstream, or
            upstream + series when ``source['with_series']`` is set.
        **source: forwarded to :func:`upstream.obtain_tree` (wheel, wheel_dir, offline, ...).

    Returns:
        The list of applied patch names.
    """
    with_series = source.pop("with_series", dest_tree is None)
    with locked(ws), _signals_raise():
        if dest_tree is None and not force:
            problems = queue_state(ws)
            if problems:
                raise ForkError(
                    "megatron/ holds work that would be lost; run `tools/fork.py export` first "
                    "(or pass --force):\n  " + "\n  ".join(problems),
                    EXIT_DIRTY,
                )
        patches = load_series(ws.patch_dir(base_name)) if with_series else []
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".materialize-", dir=ws.build))
        except OSError as exc:
            raise io_error(exc, f"cannot create a temporary folder in {ws.build}") from exc
        try:
            try:
                origin = obtain_tree(pin, base_name, tmp, **source)
            except OSError as exc:
                raise io_error(exc, f"cannot write upstream {base_name} into {tmp}") from exc
            git_dir = tmp / ".pq"
            names = _apply(base_name, patches, tmp, git_dir, origin)
            try:
                if dest_tree is not None:
                    _swap(ws, tmp / "megatron", Path(dest_tree) / "megatron")
                    return [p.name for p in patches]
                (git_dir / NAMES_FILE).write_text("".join(f"{s}\t{n}\n" for s, n in names.items()))
                (git_dir / APPLIED_FILE).write_text(
                    _fingerprint({p.name: p.path.read_text() for p in patches})
                )
                (git_dir / BASE_FILE).write_text(base_name + "\n")
                git(tmp, git_dir, "config", "core.worktree", str(ws.root))
                git(tmp, git_dir, "config", "status.showUntrackedFiles", "no")
                kept = sources_mod.snapshot(ws.root, ws.patch_root)
                _swap(ws, tmp / "megatron", ws.tree, tmp / ".pq", ws.pq, extra=(UNIT_TESTS,))
                sources_mod.restore(ws.root, kept)  # the fork's sources are never overwritten
                excludes.write(
                    ws.root, excludes.generated(ws.root, ws.tree, sources_mod.paths(ws.patch_root))
                )
            except OSError as exc:
                raise io_error(exc, f"cannot place the new tree at {ws.root}") from exc
            return [p.name for p in patches]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _apply(base_name, patches, tmp, git_dir, origin):
    """Commit the upstream tree in ``tmp`` and apply each patch with zero fuzz/offset."""
    git(tmp, git_dir, "init", "-q")
    git(tmp, git_dir, "add", "-A", "-f", "--", "megatron", *PY_CACHE)
    git(tmp, git_dir, "commit", "-q", "-m", f"upstream: megatron-core {base_name}\n\n{origin}")
    git(tmp, git_dir, "tag", "base")
    names = {}
    for patch in patches:
        outcome, detail = classify(patch, tmp)
        if outcome != CLEAN:
            raise ForkError(
                f"patch {patch.where} does not apply with zero fuzz and offset to "
                f"megatron-core {base_name} ({outcome}): {detail}",
                EXIT_APPLY,
            )
        git(tmp, git_dir, "am", "-q", "--no-3way", "--keep-cr", str(patch.path))
        names[git(tmp, git_dir, "log", "-1", "--format=%s").strip()] = patch.name
    return names


def _swap(ws, new_tree, old_tree, new_git=None, old_git=None, extra=()):
    """Replace old_tree (and old_git) by the new ones; on any failure put the old ones back.

    ``extra`` names paths relative to both roots (e.g. tests/unit_tests) that are replaced too;
    one the new tree lacks is removed, so a base whose series adds no tests leaves none behind.
    """
    pairs = [(Path(new_tree), Path(old_tree))]
    if new_git is not None:
        pairs.append((Path(new_git), Path(old_git)))
    pairs += [(Path(new_tree).parent / rel, ws.root / rel) for rel in extra]
    stash = Path(tempfile.mkdtemp(prefix=".previous-", dir=ws.build))
    moved, placed = [], []
    with _signals_blocked():
        try:
            for i, (_, old) in enumerate(pairs):
                if old.exists():
                    os.rename(old, stash / str(i))
                    moved.append((stash / str(i), old))
            for new, old in pairs:
                if not new.exists() and new != Path(new_tree):
                    continue  # an extra path the new tree does not have: it stays removed
                old.parent.mkdir(parents=True, exist_ok=True)
                os.rename(new, old)
                placed.append(old)
        except BaseException:
            for old in placed:
                shutil.rmtree(old, ignore_errors=True)
            for saved, old in moved:
                os.rename(saved, old)
            shutil.rmtree(stash, ignore_errors=True)  # empty again: everything went back
            raise
    shutil.rmtree(stash, ignore_errors=True)


def _known_names(ws):
    path = ws.pq / NAMES_FILE
    if not path.is_file():
        return {}
    return dict(line.split("\t", 1) for line in path.read_text().splitlines() if "\t" in line)


def _slug(subject, message=""):
    """A new patch's file name after its number: the ``Fork-Change:`` slug (the change's one
    name), else the whole subject made file-safe (never cut)."""
    change = re.search(r"(?m)^Fork-Change:\s*(\S+)\s*$", message)
    return change.group(1) if change else re.sub(r"[^A-Za-z0-9_.]+", "-", subject).strip("-.")


def _next_number(ws, known):
    numbers = [0]
    for name in known:
        m = re.match(r"^(\d{4})-", name.rsplit("/", 1)[-1])
        if m:
            numbers.append(int(m.group(1)))
    for base_dir in ws.patch_root.iterdir() if ws.patch_root.is_dir() else []:
        for path in base_dir.rglob("*.patch") if base_dir.is_dir() else []:
            m = re.match(r"^(\d{4})-", path.name)
            if m:
                numbers.append(int(m.group(1)))
    return max(numbers) + 1


def render_commits(
    work_tree, git_dir, revs, known=None, next_number=1, group=GROUPS[0], numbers=None
):
    """Return {series entry: patch text} for the commits in ``revs`` (oldest first).

    Args:
        work_tree: the queue's work tree.
        git_dir: the queue's git directory.
        revs: a rev-list range, e.g. ``base..HEAD``.
        known: {subject: series entry} of patches that already have a name.
        next_number: the number given to the first commit without a known name or record.
        group: the group directory of new patches.
        numbers: {slug: number} of the change records: a new patch whose ``Fork-Change:`` slug
            has a record takes the record's number (the same on every base), not the next one.
    """
    commits = git(work_tree, git_dir, "rev-list", "--reverse", revs).split()
    known, numbers = known or {}, numbers or {}
    rendered = {}
    for sha in commits:
        subject = git(work_tree, git_dir, "log", "-1", "--format=%s", sha).strip()
        name = known.get(subject)
        if name is None:
            message = git(work_tree, git_dir, "log", "-1", "--format=%B", sha)
            slug = _slug(subject, message)
            number = numbers.get(slug)
            if number is None:
                number, next_number = next_number, next_number + 1
            name = f"{group}/{number:04d}-{slug}.patch"
        if name in rendered:
            raise ForkError(f"two queue commits export to {name}; give them distinct subjects")
        rendered[name] = git(work_tree, git_dir, *EXPORT_OPTS, *FORMAT_OPTS, "-1", sha)
    return rendered


def render_patches(ws):
    """Return {series entry: patch text} for every queue commit after the base, in order, with
    the author, opening line and trailers that the change records give each patch."""
    known = _known_names(ws)
    changes = records_mod.load(ws.patch_root)
    numbers = {slug: change.number for slug, change in changes.items()}
    rendered = render_commits(
        ws.root, ws.pq, "base..HEAD", known, _next_number(ws, known.values()), numbers=numbers
    )
    return records_mod.render_rendered(rendered, changes)


def write_series(patch_dir, rendered, protect=()):
    """Write ``rendered`` as the series in ``patch_dir``; return (written, removed).

    Args:
        patch_dir: the base's series directory.
        rendered: {series entry: patch text}, in series order.
        protect: entries that may be removed (the ones the queue applied); any other patch file
            that is not in ``rendered`` stops the write (exit 6), so nothing is deleted by accident.
    """
    from .series import patch_files  # pylint: disable=import-outside-toplevel

    patch_dir = Path(patch_dir)
    patch_dir.mkdir(parents=True, exist_ok=True)
    on_disk = patch_files(patch_dir)
    strangers = [n for n in on_disk if n not in rendered and n not in protect]
    if strangers:
        raise ForkError(
            f"{patch_dir} holds files that the queue never applied: "
            + ", ".join(sorted(strangers))
            + "; list them in the series and run materialize (or move them away) before "
            "exporting, so that nothing is deleted by accident",
            EXIT_DIRTY,
        )
    written = []
    for name, text in rendered.items():
        path = patch_dir / name
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(name)
    removed = []
    for name in on_disk:
        if name not in rendered:
            (patch_dir / name).unlink()
            removed.append(name)
    series = "".join(f"{name}\n" for name in rendered)
    series_path = patch_dir / "series"
    if not series_path.is_file() or series_path.read_text() != series:
        series_path.write_text(series)
        written.append("series")
    return written, removed


def export(ws):
    """Write the queue's commits to patches/<base>/, then every source file into each base's
    patches; return (written, removed). Without a queue only the source files are written."""
    if not ws.pq.exists():
        if ws.tree.exists() and not _unsourced_files(ws):
            return sync_sources(ws), []
        raise ForkError("no patch queue: run `tools/fork.py materialize` first", EXIT_USAGE)
    _fold_sources(ws)
    dirty = _dirty(ws)
    if dirty:
        raise ForkError(
            "megatron/ has edits that are not in a queue commit; commit them with "
            "`tools/fork.py commit --to PATCH` or `tools/fork.py commit --new SUBJECT`:\n" + dirty,
            EXIT_DIRTY,
        )
    rendered = render_patches(ws)
    applied = ws.pq / APPLIED_FILE
    ours = (
        {line.split("  ", 1)[1] for line in applied.read_text().splitlines()}
        if applied.is_file()
        else set()
    )
    written, removed = write_series(ws.patch_dir(), rendered, protect=ours)
    names = {pq(ws, "log", "-1", "--format=%s", sha).strip(): name for sha, name in zip(
        pq(ws, "rev-list", "--reverse", "base..HEAD").split(), rendered)}  # fmt: skip
    (ws.pq / NAMES_FILE).write_text("".join(f"{s}\t{n}\n" for s, n in names.items()))
    (ws.pq / APPLIED_FILE).write_text(_fingerprint(rendered))
    base = ws.base()
    written = [f"{base}/{n}" for n in written]
    written += [n for n in sync_sources(ws) if n not in written]
    return written, [f"{base}/{n}" for n in removed]


def sync_sources(ws):
    """Write the fork's source files into every base's patches; return the entries rewritten."""
    return sources_mod.sync(ws.root, ws.patch_root, GIT_ENV, EXPORT_OPTS, FORMAT_OPTS)


def commit(ws, to=None, new=None, message_file=None):
    """Record the edits in megatron/ into the queue.

    Args:
        ws: the workspace.
        to: fold the edits into the commit of this patch (series entry or file name).
        new: create a new patch with this subject at the end of the series.
        message_file: the body of the new patch's message (Problem/Cause/Fix/Test); its
            trailers come from the change record on export.
    """
    if bool(to) == bool(new):
        raise ForkError("commit needs exactly one of --to PATCH or --new SUBJECT", EXIT_USAGE)
    folded = _fold_sources(ws)  # a source file's edits belong to the patch that creates it
    settled = [f":(exclude){path}" for path in _settled_sources(ws)]
    pq(ws, "add", "-A", "-f", "--", *_tracked(ws), *PY_CACHE, *settled)
    if folded and not pq(ws, "diff", "--cached", "--name-only").strip():
        return  # only source files were edited, and they are in their patches' commits now
    if new:
        body = Path(message_file).read_text() if message_file else ""
        pq(ws, "commit", "-q", "-m", f"{new}\n\n{body}".rstrip() + "\n")
        return
    by_name = {v: k for k, v in _known_names(ws).items()}
    by_name.update({v.rsplit("/", 1)[-1]: k for k, v in _known_names(ws).items()})
    if to not in by_name:
        raise ForkError(f"no queue commit for patch {to}; known: {', '.join(by_name)}", EXIT_USAGE)
    subjects = pq(ws, "log", "--format=%H %s", "base..HEAD").splitlines()
    target = next(
        line.split(" ", 1)[0] for line in subjects if line.split(" ", 1)[1] == by_name[to]
    )
    pq(ws, "commit", "-q", f"--fixup={target}")
    pq(ws, "rebase", "-q", "-i", "--autosquash", "base", env={"GIT_SEQUENCE_EDITOR": "true"})


__all__ = [
    "Workspace", "materialize", "export", "commit", "render_patches", "queue_state",
    "is_current", "read_series", "Interrupted",
]  # fmt: skip
