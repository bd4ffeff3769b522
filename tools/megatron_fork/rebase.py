"""``rebase``: carry a base's series onto a new upstream with ``git am -3``, patch by patch.

A scratch repository under ``build/rebase/repo`` holds three things: the old base as a commit
(``old-base``) with the old series applied on top (``old-tip``), and the new upstream as a commit
(``new-base``), on which the series is replayed with ``git am -3``. A patch whose change the
target already contains is dropped: from the change catalogue (``patches/changes.toml``), from
the upstream commit being an ancestor of a git target, or because ``git am`` finds nothing left
to change. A real conflict stops the rebase in git's own ``am`` state: resolve the files in the
scratch repository, ``git add`` them, and run ``tools/fork.py rebase --continue`` (or
``--abort``). At the end the new series is written to ``patches/<name>/`` and
``git range-diff`` of old against new is printed.
"""

import json
import re
import shutil
import subprocess

from . import EXIT_CONFLICT, EXIT_UNAVAILABLE, EXIT_USAGE, ForkError
from . import queue as queue_mod
from . import records as records_mod
from . import series as series_mod
from . import upstream

STATE = "state.json"


def _dir(ws):
    return ws.build / "rebase"


def _git(repo, *args, check=True):
    env = {**queue_mod.GIT_ENV}
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, **env},
    )
    if check and proc.returncode != 0:
        raise ForkError(f"git {' '.join(args[:2])} failed: {proc.stderr.strip()}", EXIT_USAGE)
    return proc


def _commit_tree(repo, message, fill):
    """Replace the work tree's megatron/ by ``fill(dest)`` and commit it; return the sha."""
    shutil.rmtree(repo / "megatron", ignore_errors=True)
    fill(repo)
    _git(repo, "add", "-A", "-f", "--", "megatron", *queue_mod.PY_CACHE)
    _git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return _git(repo, "rev-parse", "HEAD").stdout.strip()


def _target(pin, onto, git_repo, source):
    """Return (name, description, fill function, target sha or None) of the rebase target."""
    if onto in pin["bases"]:
        src = dict(source)
        if not upstream.is_git_base(pin, onto):
            src.update(git_repo=None, rev=None)

        def fill(dest):
            upstream.obtain_tree(pin, onto, dest, **src)

        sha = pin["bases"][onto].get("commit")
        return onto, f"megatron-core {onto}", fill, sha
    if not git_repo:
        raise ForkError(
            f"{onto!r} is not a pinned base; pass --git-repo PATH-TO-Megatron-LM to use it as a "
            "git ref",
            EXIT_UNAVAILABLE,
        )
    sha = upstream.resolve_rev(git_repo, onto)

    def fill_ref(dest):
        upstream.extract_git(git_repo, sha, dest)

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", onto)
    return name, f"Megatron-LM {onto} ({sha[:12]})", fill_ref, sha


def _contained(changes, patch, name, git_repo, target_sha):
    """Say why the target already contains ``patch``'s change, or return None."""
    record = records_mod.upstream_record(changes, patch.change, name)
    if record:
        return records_mod.describe_upstream(record)
    change = changes.get(patch.change)
    commit = (change.upstream_commit if change is not None else None) or (
        patch.upstream_commits[0] if patch.upstream_commits else None
    )
    if commit and git_repo and target_sha:
        proc = subprocess.run(
            ["git", "-C", str(git_repo), "merge-base", "--is-ancestor", commit, target_sha],
            capture_output=True,
        )
        if proc.returncode == 0:
            return f"upstream commit {commit[:10]} is an ancestor of the target"
    return None


def start(pin, ws, base, onto, git_repo=None, name=None, source=None):
    """Begin rebasing ``base``'s series onto ``onto``; return the report (or raise at a conflict).

    Args:
        pin: the loaded pin.
        ws: the workspace (its ``patches/`` and ``build/``).
        base: the maintained base whose series is carried.
        onto: a base of the pin (a release version or dev) or a git ref of ``git_repo``.
        git_repo: a Megatron-LM clone (needed for git bases and refs).
        name: the base name the new series is written as (default: ``onto``).
        source: upstream source options (wheel dir, offline).
    """
    state_dir = _dir(ws)
    if (state_dir / STATE).is_file():
        raise ForkError(
            f"a rebase is in progress in {state_dir}; run `tools/fork.py rebase --continue` or "
            "`--abort`",
            EXIT_USAGE,
        )
    source = dict(source or {}, git_repo=git_repo)
    old_patches = series_mod.load_series(ws.patch_dir(base))
    target_name, description, fill, target_sha = _target(pin, onto, git_repo, source)
    name = name or target_name
    shutil.rmtree(state_dir, ignore_errors=True)
    repo = state_dir / "repo"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    old_src = dict(source)
    if not upstream.is_git_base(pin, base):
        old_src.update(git_repo=None, rev=None)
    _commit_tree(
        repo, f"upstream: {base}", lambda dest: upstream.obtain_tree(pin, base, dest, **old_src)
    )
    _git(repo, "tag", "old-base")
    for patch in old_patches:
        _git(repo, "am", "-q", "--no-3way", "--keep-cr", str(patch.path))
    _git(repo, "tag", "old-tip")
    _git(repo, "checkout", "-q", "-b", "rebased", "old-base")
    _commit_tree(repo, f"upstream: {description}", fill)
    _git(repo, "tag", "new-base")
    state = {
        "base": base,
        "onto": onto,
        "name": name,
        "target_sha": target_sha,
        "git_repo": str(git_repo) if git_repo else None,
        "pending": [p.name for p in old_patches],
        "done": [],
        "dropped": [],
    }
    _save(ws, state)
    return _run(pin, ws, state)


def _save(ws, state):
    (_dir(ws) / STATE).write_text(json.dumps(state, indent=1) + "\n")


def _load(ws):
    path = _dir(ws) / STATE
    if not path.is_file():
        raise ForkError("no rebase in progress", EXIT_USAGE)
    return json.loads(path.read_text())


def _patch(ws, state, entry):
    return series_mod.parse_patch(ws.patch_dir(state["base"]) / entry, entry)


def _run(pin, ws, state):
    """Apply the pending patches one by one; stop at a conflict; finish when none is left."""
    repo = _dir(ws) / "repo"
    changes = records_mod.load(ws.patch_root)
    existing = _existing_ports(ws, state["name"])
    while state["pending"]:
        entry = state["pending"][0]
        patch = _patch(ws, state, entry)
        why = _contained(changes, patch, state["name"], state["git_repo"], state["target_sha"])
        if why:
            state["dropped"].append([entry, why])
            state["pending"].pop(0)
            _save(ws, state)
            continue
        before = _git(repo, "rev-parse", "HEAD").stdout.strip()
        proc = _git(repo, "am", "-3", "-q", "--keep-cr", str(patch.path), check=False)
        if proc.returncode != 0:
            text = proc.stdout + proc.stderr
            if "No changes" in text or "already applied" in text:
                _git(repo, "am", "--skip", check=False)
                state["dropped"].append([entry, "the target already has its changes (empty)"])
            elif patch.change in existing:
                _git(repo, "am", "--abort", check=False)
                port = existing[patch.change]
                done = _git(repo, "am", "-3", "-q", "--keep-cr", str(port.path), check=False)
                if done.returncode != 0:
                    _git(repo, "am", "--abort", check=False)
                    _git(repo, "am", "-3", "-q", "--keep-cr", str(patch.path), check=False)
                    _save(ws, state)
                    raise _conflict(ws, repo, entry)
                state["done"].append([entry, f"conflict resolved by the existing port {port.name}"])
            else:
                _save(ws, state)
                raise _conflict(ws, repo, entry)
        elif _git(repo, "rev-parse", "HEAD").stdout.strip() == before:
            state["dropped"].append([entry, "the target already has its changes (empty)"])
        else:
            state["done"].append([entry, "applied (git am -3)"])
        state["pending"].pop(0)
        _save(ws, state)
    return _finish(ws, state)


def _existing_ports(ws, name):
    """{change slug: patch} of an existing series of base ``name`` (its resolved conflicts)."""
    patch_dir = ws.patch_dir(name)
    if not (patch_dir / "series").is_file():
        return {}
    return {p.change: p for p in series_mod.load_series(patch_dir) if p.change}


def _conflict(ws, repo, entry):
    """Describe the conflict git am left: patch, files and hunks (conflict-marker lines)."""
    files = _git(repo, "diff", "--name-only", "--diff-filter=U").stdout.split()
    parts = []
    for rel in files:
        try:
            lines = (repo / rel).read_text().splitlines()
        except OSError:
            lines = []
        starts = [i + 1 for i, line in enumerate(lines) if line.startswith("<<<<<<< ")]
        for start in starts:
            first = next((line.strip() for line in lines[start:] if line.strip()), "(empty)")
            parts.append(f"file {rel}: hunk at line {start}: {first[:80]!r}")
        if not starts:
            parts.append(f"file {rel}: conflict")
    if not parts:
        parts.append(
            "git am could not apply it: "
            + _git(repo, "am", "--show-current-patch=diff", check=False).stderr.strip()[:200]
        )
    return ForkError(
        f"rebase stopped: patch {entry} conflicts\n  "
        + "\n  ".join(parts)
        + f"\nresolve the files in {repo}, `git -C {repo} add` them, then run "
        "`tools/fork.py rebase --continue` (or `--abort`; nothing is lost either way)",
        EXIT_CONFLICT,
    )


def cont(pin, ws):
    """Continue after the developer resolved a conflict (``git am --continue``)."""
    state = _load(ws)
    repo = _dir(ws) / "repo"
    if (repo / ".git" / "rebase-apply").exists():
        proc = _git(repo, "am", "--continue", check=False)
        if proc.returncode != 0:
            raise ForkError(
                "git am --continue failed (are all conflicts resolved and added?): "
                + (proc.stdout + proc.stderr).strip()[-300:],
                EXIT_CONFLICT,
            )
        state["done"].append([state["pending"].pop(0), "conflict resolved by hand"])
        _save(ws, state)
    return _run(pin, ws, state)


def abort(ws):
    """Drop the rebase in progress; patches/ was never touched."""
    state_dir = _dir(ws)
    if not state_dir.exists():
        return "no rebase in progress"
    shutil.rmtree(state_dir)
    return f"rebase aborted; removed {state_dir} (patches/ unchanged)"


def _finish(ws, state):
    repo = _dir(ws) / "repo"
    old = {p.subject: p.name for p in series_mod.load_series(ws.patch_dir(state["base"]))}
    rendered = queue_mod.render_commits(repo, repo / ".git", "new-base..HEAD", known=old)
    patch_dir = ws.patch_dir(state["name"])
    protect = series_mod.patch_files(patch_dir) if patch_dir.is_dir() else []
    written, removed = queue_mod.write_series(patch_dir, rendered, protect=protect)
    range_diff = _git(
        repo, "-c", "core.pager=cat", "range-diff", "--no-color", "old-base..old-tip",
        "new-base..HEAD", check=False,
    ).stdout  # fmt: skip
    lines = [f"rebase {state['base']} -> {state['name']} ({state['onto']}):"]
    lines += [f"  kept    {entry}: {why}" for entry, why in state["done"]]
    lines += [f"  dropped {entry}: {why}" for entry, why in state["dropped"]]
    lines.append(
        f"wrote patches/{state['name']}/ ({len(rendered)} patches; "
        f"{len(written)} files changed, {len(removed)} removed)"
    )
    lines += ["", "git range-diff old-base..old-tip new-base..HEAD:", range_diff.rstrip()]
    shutil.rmtree(_dir(ws), ignore_errors=True)
    return "\n".join(lines)
