"""The drop-in's distribution metadata: the requirements and extras of the upstream it replaces.

A user who installs ``megatron-core[te]`` or ``megatron-core[dev]`` against the fork must get what
upstream's release declares, so the fork copies them from the pinned upstream itself: the
``METADATA`` of the hash-verified wheel (release bases) or ``pyproject.toml`` of the pinned commit
(git bases). Nothing here is written by hand, so a new base brings its own list.
"""

import email.parser
import re
import tomllib
import zipfile
from pathlib import Path

from . import ForkError, EXIT_UNAVAILABLE

_EXTRA = re.compile(r"""^(?P<req>.*?)\s*;\s*(?:(?P<marker>.*?)\s+and\s+)?extra\s*==\s*['"](?P<extra>[^'"]+)['"]\s*$""")


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
