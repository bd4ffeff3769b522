"""The clone's own ignore rules for the materialized upstream files.

``materialize`` writes upstream's files into megatron/ next to the fork's own source files, which
are tracked. The repository's .gitignore cannot tell the two apart without naming every upstream
file, so materialize names them, per clone, in git's ``info/exclude`` (between the markers
below): ``git status`` then shows a new file in megatron/ as untracked, and a plain ``git add``
takes it.
"""

import subprocess
from pathlib import Path

BEGIN = "# >>> tools/fork.py materialize: upstream files of the materialized tree (generated)"
END = "# <<< tools/fork.py materialize"


def exclude_file(root):
    """The path of ``root``'s ``info/exclude``, or None where ``root`` is not a git work tree."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "--git-path", "info/exclude"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 2:
        return None
    if Path(lines[0]).resolve() != Path(root).resolve():
        return None  # a folder inside another repository: leave that repository's rules alone
    path = Path(lines[1])
    return path if path.is_absolute() else Path(root) / path


def write(root, generated):
    """Name ``generated`` (paths relative to ``root``) in the clone's exclude file, replacing the
    block a previous materialize wrote; the rest of the file is kept. Returns the file or None."""
    path = exclude_file(root)
    if path is None:
        return None
    old = path.read_text() if path.is_file() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        old = head + rest.split(END, 1)[1].lstrip("\n")
    block = "\n".join([BEGIN, *(f"/{p}" for p in sorted(generated)), END])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(old.rstrip("\n") + ("\n" if old.strip() else "") + block + "\n")
    return path


def generated(root, tree, sources):
    """Every file under ``tree`` (relative to ``root``) that is not one of ``sources``."""
    keep = set(sources)
    files = (p.relative_to(root).as_posix() for p in Path(tree).rglob("*") if p.is_file())
    return [f for f in files if f not in keep and "__pycache__" not in f]
