"""The drop-in's distribution metadata: the requirements and extras of the upstream it replaces,
and the install manifest that ``megatron-fork-verify`` checks.

A user who installs ``megatron-core[te]`` or ``megatron-core[dev]`` against the fork must get what
upstream's release declares, so the fork copies them from the pinned upstream itself: the
``METADATA`` of the hash-verified wheel (release bases) or ``pyproject.toml`` of the pinned commit
(git bases). Nothing here is written by hand, so a new base brings its own list.
"""

import email.parser
import hashlib
import re
import subprocess
import tomllib
import zipfile
from pathlib import Path

from . import EXIT_UNAVAILABLE, ForkError, upstream
from .manifest import sha256_file
from .series import series_digest

_EXTRA = re.compile(
    r"""^(?P<req>.*?)\s*;\s*(?:(?P<marker>.*?)\s+and\s+)?"""
    r"""extra\s*==\s*['"](?P<extra>[^'"]+)['"]\s*$"""
)


def from_metadata(text):
    """Split a wheel's ``METADATA`` into (install_requires, extras_require).

    Args:
        text: the METADATA file's text.

    Returns:
        ``(list of requirement strings, {extra: [requirement strings]})``; every ``Provides-Extra``
        appears as a key, also one without requirements (upstream's ``lts``).
    """
    msg = email.parser.Parser().parsestr(text, headersonly=True)
    requires, extras = [], {name: [] for name in msg.get_all("Provides-Extra") or []}
    for line in msg.get_all("Requires-Dist") or []:
        match = _EXTRA.match(line)
        if match is None:
            requires.append(line.strip())
            continue
        req = match["req"] + (f"; {match['marker']}" if match["marker"] else "")
        extras.setdefault(match["extra"], []).append(req)
    return requires, extras


def from_pyproject(text):
    """(install_requires, extras_require) of a ``pyproject.toml`` text (its ``[project]`` table)."""
    project = tomllib.loads(text).get("project", {})
    return list(project.get("dependencies", [])), {
        name: list(reqs) for name, reqs in project.get("optional-dependencies", {}).items()
    }


def wheel_metadata(wheel_path):
    """The text of ``*.dist-info/METADATA`` inside a wheel."""
    with zipfile.ZipFile(wheel_path) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ForkError(f"{wheel_path}: expected one .dist-info/METADATA, found {len(names)}")
        return zf.read(names[0]).decode("utf-8")


def upstream_requirements(wheel_path):
    """(install_requires, extras_require) declared by the pinned upstream wheel at ``wheel_path``.

    Args:
        wheel_path: the hash-verified upstream wheel (``upstream.fetch_wheel``).
    """
    if not Path(wheel_path).is_file():
        raise ForkError(f"upstream wheel {wheel_path} is not available", EXIT_UNAVAILABLE)
    return from_metadata(wheel_metadata(wheel_path))


def requirements_for(pin, base, wheel_dir=None, git_repo=None):
    """(install_requires, extras_require) of pinned upstream ``base``.

    Args:
        pin: the loaded pin.
        base: a base name of the pin.
        wheel_dir: a folder with the pinned wheel (offline builds); the cache is always searched.
        git_repo: for a git base (dev), a Megatron-LM checkout that has the pinned commit; its
            ``pyproject.toml`` at that commit declares the requirements.
    """
    entry = pin["bases"][base]
    if not upstream.is_git_base(pin, base):
        return upstream_requirements(
            upstream.fetch_wheel(pin, base, wheel_dir=wheel_dir, offline=True)
        )
    if not git_repo:
        raise ForkError(
            f"base {base} is a Megatron-LM commit: name the checkout with MEGATRON_FORK_GIT_REPO "
            "(tools/install.sh --git-repo sets it)",
            EXIT_UNAVAILABLE,
        )
    proc = subprocess.run(
        ["git", "-C", str(git_repo), "show", f"{entry['commit']}:pyproject.toml"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise ForkError(
            f"cannot read pyproject.toml at {entry['commit']} from {git_repo}: "
            f"{proc.stderr.strip()}",
            EXIT_UNAVAILABLE,
        )
    return from_pyproject(proc.stdout)


def build_manifest(lib_root, pin, base_name, patches, fork_version):
    """Describe an install: base, hashes, applied patches and every shipped megatron file.

    Args:
        lib_root: the directory that holds the ``megatron/`` being installed.
        pin: the loaded pin.
        base_name: the base the tree was built on.
        patches: the applied patch objects, in order.
        fork_version: the distribution version, e.g. ``0.18.2+fork.5``.
    """
    lib_root = Path(lib_root)
    base = pin["bases"][base_name]
    files = {
        p.relative_to(lib_root).as_posix(): sha256_file(p)
        for p in sorted(lib_root.glob("megatron/**/*"))
        if p.is_file() and p.suffix in (".py", ".cpp", ".md", ".txt", ".json", ".yaml")
    }
    return {
        "distribution": "megatron-core",
        "version": fork_version,
        "base": {
            "name": base_name,
            "wheel": base.get("wheel"),
            "sha256": base.get("sha256"),
            "commit": base.get("commit"),
            "py_tree_sha256": base["py_tree_sha256"],
        },
        "series_sha256": series_digest(patches),
        "cherry_pick_target": pin["bases"].get(pin.get("primary"), {}).get("commit"),
        "patches": [
            {
                "name": p.name,
                "sha256": hashlib.sha256(p.path.read_bytes()).hexdigest(),
                "forwarded": p.forwarded,
            }
            for p in patches
        ],
        "files": files,
    }
