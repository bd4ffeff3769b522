"""The fork's own files: tracked once, at the path they take in upstream's tree.

A file that a patch creates (a ``new file`` diff) is one the fork wrote. It is tracked in this
repository at its upstream path (``megatron/training/warmup.py``, ``tests/unit_tests/...``), and
that file is the only place to edit it: :func:`sync` (run by ``export``) writes it into every
base's patch that creates it, :func:`drift` (run by ``check``) names every patch that carries
other bytes, and ``materialize`` puts the files back as they were after swapping in a new tree.
"""

import re
import subprocess
import tempfile
from pathlib import Path

from . import EXIT_USAGE, ForkError
from .series import read_series

DIFF_START = re.compile(r"^diff --git ", re.M)
NEW_FILE = re.compile(
    r"\Adiff --git a/(?P<path>\S+) b/(?P=path)\n"
    r"new file mode (?P<mode>\d+)\nindex 0+\.\.[0-9a-f]+\n"
)
STAT_LINE = re.compile(r"^ \S.* \| ", re.M)


def _split(text):
    """Split a format-patch text into (head up to and including ``---``, stat block, diffs)."""
    first = DIFF_START.search(text)
    if first is None:
        return text, "", []
    head, body = text[: first.start()], text[first.start() :]
    cut = head.rfind("\n---\n")
    if cut < 0:
        raise ForkError("a patch without a `---` line before its first diff", EXIT_USAGE)
    starts = [m.start() for m in DIFF_START.finditer(body)] + [len(body)]
    diffs = [body[a:b] for a, b in zip(starts, starts[1:])]
    return head[: cut + 5], head[cut + 5 :], diffs


def created(text):
    """Return {path: file content} of the files a patch text creates."""
    files = {}
    for diff in _split(text)[2]:
        m = NEW_FILE.match(diff)
        if m:
            files[m["path"]] = _content(diff)
    return files


def _content(diff):
    """The bytes a new-file diff creates."""
    lines, out = diff.split("\n")[:-1], []
    in_hunk = False
    for line in lines:
        if line.startswith("@@ "):
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            out.append(line[1:] + "\n")
        elif in_hunk and line == "\\ No newline at end of file" and out:
            out[-1] = out[-1][:-1]
    return "".join(out)


def _counts(diff):
    """(lines added, lines removed) of one file's diff."""
    added = removed = 0
    in_hunk = False
    for line in diff.split("\n"):
        if line.startswith("@@ "):
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            added += 1
        elif in_hunk and line.startswith("-"):
            removed += 1
    return added, removed


def _path(diff):
    return diff.split("\n", 1)[0].split(" b/", 1)[1]


def _render(diffs, contents, git_env, export_opts, format_opts):
    """Let git write the stat block and the new-file diffs for ``contents`` ({path: text}).

    The other files of the patch get stand-in contents with their own line counts, so git's
    diffstat (column widths, bar scaling) comes out as format-patch writes it for the real tree.
    """
    with tempfile.TemporaryDirectory(prefix="fork-sources-") as tmp:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *export_opts, "-c", "diff.renames=false", *a],
            cwd=tmp, env=git_env, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        run("init", "-q")
        new = {}
        for diff in diffs:
            path = _path(diff)
            if NEW_FILE.match(diff):
                new[path] = contents.get(path, _content(diff))
                continue
            if not diff.startswith(f"diff --git a/{path} b/{path}\nindex "):
                raise ForkError(f"{path}: only modified and new files can be re-rendered", 1)
            added, removed = _counts(diff)
            target = Path(tmp, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("".join(f"old {i}\n" for i in range(removed)))
            new[path] = "".join(f"new {i}\n" for i in range(added))
        run("add", "-A")
        run("commit", "-q", "--allow-empty", "-m", "before")
        for path, text in new.items():
            target = Path(tmp, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        run("add", "-A")
        run("commit", "-q", "-m", "after")
        rendered = run(*format_opts, "-1", "HEAD")
    _, stat, out = _split(rendered)
    return stat, {_path(d): d for d in out}


def rewrite(text, contents, git_env, export_opts, format_opts):
    """Return ``text`` with the files it creates replaced by ``contents`` ({path: text})."""
    head, _, diffs = _split(text)
    wanted = {p: c for p, c in contents.items() if created(text).get(p, c) != c}
    if not wanted:
        return text
    stat, rendered = _render(diffs, wanted, git_env, export_opts, format_opts)
    return head + stat + "".join(rendered[_path(d)] if _path(d) in wanted else d for d in diffs)


def creators(patch_root):
    """Return {path: [(base, series entry), ...]} of every file a carried patch creates."""
    found = {}
    for series in sorted(Path(patch_root).glob("*/series")):
        for entry in read_series(series.parent):
            for path in created((series.parent / entry).read_text()):
                found.setdefault(path, []).append((series.parent.name, entry))
    return found


def paths(patch_root):
    """The fork's source files (paths relative to the repository root), sorted."""
    return sorted(creators(patch_root))


def foreign(patch_root, base):
    """Sources that ``base``'s series does not create (kept in the tree, left out of its wheel)."""
    return [p for p, where in creators(patch_root).items() if base not in {b for b, _ in where}]


def drift(root, patch_root):
    """Return one line per patch whose created file differs from its source (or has none)."""
    problems = []
    for path, where in creators(patch_root).items():
        source = Path(root) / path
        for base, entry in where:
            rel = f"patches/{base}/{entry}"
            if not source.is_file():
                problems.append(f"{rel} creates {path}, which is not tracked as a source file")
            elif created((Path(patch_root) / base / entry).read_text())[path] != source.read_text():
                problems.append(
                    f"{rel} carries another {path} than the source file; run `tools/fork.py "
                    "export` to write the source into every base's patch"
                )
    return problems


def sync(root, patch_root, git_env, export_opts, format_opts):
    """Write every source file into each patch that creates it; return the patches rewritten."""
    written = []
    by_patch = {}
    for path, where in creators(patch_root).items():
        source = Path(root) / path
        if source.is_file():
            for base, entry in where:
                by_patch.setdefault((base, entry), {})[path] = source.read_text()
    for (base, entry), contents in sorted(by_patch.items()):
        patch = Path(patch_root) / base / entry
        text = patch.read_text()
        new = rewrite(text, contents, git_env, export_opts, format_opts)
        if new != text:
            patch.write_text(new)
            written.append(f"{base}/{entry}")
    return written


def snapshot(root, patch_root):
    """{path: bytes} of the source files now on disk (``materialize`` puts them back)."""
    files = {}
    for path in paths(patch_root):
        source = Path(root) / path
        if source.is_file():
            files[path] = source.read_bytes()
    return files


def restore(root, files):
    """Write back the files of :func:`snapshot` that a new tree lacks or carries otherwise."""
    for path, data in files.items():
        target = Path(root) / path
        if not target.is_file() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
