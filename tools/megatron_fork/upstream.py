"""The upstream pin (patches/upstream.toml) and how a pinned upstream tree is obtained."""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
import zlib
from pathlib import Path

from . import EXIT_HASH, EXIT_UNAVAILABLE, EXIT_USAGE, ForkError
from .manifest import sha256_file

PIN_LABEL = "patches/upstream.toml"  # how messages name the pin (Workspace.pin_file)
# Upstream files that are shipped in the wheel but are build products, not sources.
SKIPPED_SUFFIXES = (".so", ".pyc")


def cache_dir():
    """Return the wheel cache directory ($MEGATRON_FORK_CACHE or ~/.cache/megatron-fork)."""
    root = os.environ.get("MEGATRON_FORK_CACHE") or Path.home() / ".cache" / "megatron-fork"
    return Path(root)


def load_pin(path):
    """Load and validate the pin file.

    Args:
        path: the TOML file to read (``Workspace.pin_file``, or the CLI's ``--pin``).

    Returns:
        The parsed dictionary.
    """
    try:
        with open(path, "rb") as f:
            pin = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ForkError(f"cannot read the upstream pin {path}: {exc}", EXIT_USAGE) from exc
    bases = pin.get("bases", {})
    for name, base in bases.items():
        keys = ("commit", "py_tree_sha256") if "commit" in base else WHEEL_KEYS
        for key in keys:
            if key not in base:
                raise ForkError(f"{path}: base {name!r} lacks {key!r}", EXIT_USAGE)
    for key in ("primary", "default"):
        if pin.get(key) not in bases:
            raise ForkError(f"{path}: {key!r} must name one of the [bases]", EXIT_USAGE)
    unknown = [n for n in pin.get("maintained", []) if n not in bases]
    if unknown or pin["primary"] not in pin.get("maintained", []):
        raise ForkError(
            f"{path}: 'maintained' must list known bases including the primary", EXIT_USAGE
        )
    return pin


WHEEL_KEYS = ("version", "wheel", "sha256", "py_tree_sha256")


def base_entry(pin, name):
    """Return the pin entry of base ``name`` or fail naming the known bases."""
    bases = pin["bases"]
    if name not in bases:
        raise ForkError(
            f"unknown base {name!r}: {PIN_LABEL} pins {', '.join(bases)}; pass one of those",
            EXIT_USAGE,
        )
    return bases[name]


def is_git_base(pin, name):
    """True when base ``name`` is pinned as a Megatron-LM commit (read from a checkout)."""
    return "commit" in base_entry(pin, name)


def releases(pin):
    """The maintained bases pinned as released wheels (not Megatron-LM commits), in pin order."""
    return [name for name in pin["maintained"] if not is_git_base(pin, name)]


def series_base(pin, name):
    """Return the maintained base whose series applies to base ``name`` (itself if maintained)."""
    if name in pin.get("maintained", []):
        return name
    return base_entry(pin, name).get("series", pin["primary"])


def py_tree_digest(root):
    """Digest of every ``megatron/**/*.py`` under ``root``: sha256 of sorted "hash  path" lines.

    It identifies an upstream source tree independently of how it was obtained (wheel or git).

    Args:
        root: a directory that contains ``megatron/``.
    """
    root = Path(root)
    lines = []
    for path in sorted(p.relative_to(root).as_posix() for p in root.glob("megatron/**/*.py")):
        lines.append(f"{sha256_file(root / path)}  {path}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _pinned(actual, pinned, mismatch):
    """Fail with exit 3 when a computed digest is not the pinned one.

    Args:
        actual: the digest computed from what was obtained.
        pinned: the digest the pin records.
        mismatch: the start of the message, naming what was obtained and what it should be.
    """
    if actual != pinned:
        raise ForkError(
            f"{mismatch}: got {actual}, the pin says {pinned}; refusing to use it", EXIT_HASH
        )


def _verified(path, base):
    _pinned(
        sha256_file(path),
        base["sha256"],
        f"sha256 mismatch for {path} (pinned for megatron-core {base['version']})",
    )
    return path


def fetch_wheel(pin, name, wheel=None, wheel_dir=None, offline=False):
    """Return the path of the hash-verified wheel of base ``name``, downloading it if allowed.

    Args:
        pin: the loaded pin.
        name: the base name, e.g. "0.18.2".
        wheel: an explicit local wheel file to use (verified against the pin).
        wheel_dir: a directory holding pre-downloaded wheels (offline builds).
        offline: never touch the network; use ``wheel``, ``wheel_dir`` or the cache only.
    """
    base = base_entry(pin, name)
    if wheel:
        if not Path(wheel).is_file():
            raise ForkError(f"wheel {wheel} does not exist", EXIT_UNAVAILABLE)
        return _verified(Path(wheel), base)
    candidates = [Path(d) / base["wheel"] for d in filter(None, [wheel_dir, cache_dir()])]
    for candidate in candidates:
        if candidate.is_file():
            return _verified(candidate, base)
    if offline:
        looked = ", ".join(str(c) for c in candidates)
        raise ForkError(
            f"megatron-core {base['version']} is not available offline (looked for {looked}); "
            "pass --wheel FILE, --wheel-dir DIR or --git-repo DIR, or run once with network",
            EXIT_UNAVAILABLE,
        )
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
            "--disable-pip-version-check", "-q", "-d", tmp,
            f"{base.get('distribution', 'megatron-core')}=={base['version']}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / base["wheel"]
        if proc.returncode != 0 or not got.is_file():
            raise ForkError(
                f"could not download megatron-core {base['version']} ({pip_error(proc.stderr)}); "
                f"without network, pass --offline --wheel-dir DIR, DIR holding {base['wheel']} "
                f"(`tools/fork.py fetch --base {name} --dest DIR` on a machine with network)"
                + (
                    f", or --git-repo PATH-TO-Megatron-LM (tag {base['git_tag']})"
                    if base.get("git_tag")
                    else ""
                ),
                EXIT_UNAVAILABLE,
            )
        _verified(got, base)
        os.replace(got, cache / base["wheel"])
    return cache / base["wheel"]


def pip_error(stderr):
    """pip's own reason in one line: its last ``ERROR:`` line (else its last line), whole words."""
    lines = [" ".join(line.split()) for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    text = (errors or lines or ["pip gave no reason"])[-1]
    return text if len(text) <= 240 else text[:240].rsplit(" ", 1)[0] + " ..."


def copy_wheel(path, dest):
    """Copy a verified wheel into the folder ``dest`` (created); return the copy's path."""
    dest = Path(dest)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / Path(path).name
        if not target.is_file() or sha256_file(target) != sha256_file(path):
            tmp = dest / f".{target.name}.part"
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)
    except OSError as exc:
        raise ForkError(f"cannot copy {Path(path).name} into {dest}: {exc.strerror}", 9) from exc
    return target


def extract_wheel(wheel_path, dest):
    """Extract the upstream sources (``megatron/**``, no build products) of a wheel to ``dest``."""
    try:
        with zipfile.ZipFile(wheel_path) as zf:
            for info in zf.infolist():
                name = info.filename
                if not name.startswith("megatron/") or name.endswith("/"):
                    continue
                if name.endswith(SKIPPED_SUFFIXES):
                    continue
                target = Path(dest) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ForkError(
            f"{Path(wheel_path).name} is a corrupt archive although its sha256 matches "
            f"({type(exc).__name__}: {exc}); delete it from the cache and fetch again",
            9,
        ) from exc


def resolve_rev(repo, rev):
    """Return the full commit sha of ``rev`` in the git repository ``repo``."""
    if not Path(repo).exists():
        raise ForkError(f"git checkout {repo} does not exist", EXIT_UNAVAILABLE)
    proc = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise ForkError(f"{repo} has no revision {rev!r}", EXIT_UNAVAILABLE)
    return proc.stdout.strip()


def extract_git(repo, rev, dest):
    """Extract ``megatron/core`` and ``megatron/training`` of a local Megatron-LM checkout."""
    resolve_rev(repo, rev)
    archive = subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "archive",
            "--format=tar",
            rev,
            "megatron/core",
            "megatron/training",
        ],
        capture_output=True,
    )
    if archive.returncode != 0:
        raise ForkError(
            f"cannot read revision {rev!r} from {repo}: {archive.stderr.decode().strip()}",
            EXIT_UNAVAILABLE,
        )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def obtain_tree(
    pin, name, dest, wheel=None, wheel_dir=None, offline=False, git_repo=None, rev=None
):
    """Write the pristine upstream tree of base ``name`` into ``dest`` and return a description.

    Args:
        pin: the loaded pin.
        name: the base name.
        dest: an empty directory; ``dest/megatron`` is created.
        wheel: see :func:`fetch_wheel`.
        wheel_dir: see :func:`fetch_wheel`.
        offline: see :func:`fetch_wheel`.
        git_repo: a local Megatron-LM checkout to read instead of the wheel (required for a base
            pinned as a commit, such as dev).
        rev: the revision of ``git_repo`` (default: the pinned commit or the base's ``git_tag``).
    """
    base = base_entry(pin, name)
    if is_git_base(pin, name):
        if not git_repo:
            raise ForkError(
                f"base {name} is Megatron-LM commit {base['commit'][:12]}: pass --git-repo "
                "PATH-TO-Megatron-LM (a clone that has that commit)",
                EXIT_UNAVAILABLE,
            )
        rev = rev or base["commit"]
        sha = resolve_rev(git_repo, rev)
        if sha != base["commit"]:
            raise ForkError(
                f"{git_repo}@{rev} is commit {sha[:12]}, but base {name} is pinned to "
                f"{base['commit'][:12]} ({base.get('date', '')})",
                EXIT_HASH,
            )
    elif git_repo:
        rev = rev or base.get("git_tag")
        if rev is None:
            raise ForkError(
                f"megatron-core {name}: no Megatron-LM ref equals its wheel (nearest: "
                f"{base.get('nearest_ref', 'none')}; see {PIN_LABEL}), so "
                f"--git-repo cannot build it; pass --offline --wheel-dir DIR, DIR holding "
                f"{base['wheel']} (`tools/fork.py fetch --base {name} --dest DIR` makes it)",
                EXIT_UNAVAILABLE,
            )
    if git_repo:
        extract_git(git_repo, rev, dest)
        _pinned(
            py_tree_digest(dest),
            base["py_tree_sha256"],
            f"{git_repo}@{rev} is not megatron-core {name} (the digest of its megatron/**/*.py)",
        )
        return f"{git_repo}@{rev}"
    path = fetch_wheel(pin, name, wheel=wheel, wheel_dir=wheel_dir, offline=offline)
    extract_wheel(path, dest)
    return f"{path.name} (sha256 {base['sha256']})"
