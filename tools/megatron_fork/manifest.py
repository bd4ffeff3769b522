"""``verify`` of an installed fork against its manifest: the one module of ``megatron_fork`` that
the wheel ships (``megatron-fork-verify``). Standard library only, no other module of the tool;
the manifest itself is written at build time by ``dist.build_manifest``."""

import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

MANIFEST_NAME = "manifest.json"
# Names that only the test suite's CUDA-on-CPU redirect uses; none may ever ship.
TEST_ONLY_MARKERS = ("cpu_redirect", "tests/harness")
# The parts of the ``megatron`` namespace that the fork ships (as upstream megatron-core does).
# Everything else under ``megatron/`` belongs to sibling distributions (Megatron-Bridge,
# megatron-energon, ...) that share the namespace; verify lists those and leaves them alone.
OWNED_PACKAGES = ("megatron/core/", "megatron/training/")


def sha256_file(path):
    """Return the hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def installed_manifest():
    """Return the manifest path of the installed megatron-core distribution (it may not exist)."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return Path(__file__).resolve().parent / MANIFEST_NAME
    return Path(dist.locate_file(f"megatron_fork/{MANIFEST_NAME}"))


def verify(manifest_path=None, do_import=False):
    """Check the installed ``megatron`` against the manifest.

    Args:
        manifest_path: the manifest to check against (default: the installed one).
        do_import: also import megatron.core and megatron.training.

    Returns:
        (ok, report lines)
    """
    if manifest_path is None:
        manifest_path = installed_manifest()
    manifest_path = Path(manifest_path)
    if not manifest_path.is_file():
        return False, [_no_manifest_reason(manifest_path)]
    manifest = json.loads(manifest_path.read_text())
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.origin:
        return False, ["megatron.core is not importable"]
    core_dir = Path(spec.origin).resolve().parent
    root = core_dir.parent.parent
    report = [f"megatron.core resolves to {core_dir}"]
    problems = _install_problems(manifest_path, manifest, core_dir, root)
    report += problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    ok = not problems
    report.append(_summary_line(manifest))
    siblings = sibling_distributions(root)
    if siblings:
        report.append(
            "beside the fork in the megatron namespace (not checked): "
            + ", ".join(f"{name} {ver} ({', '.join(pkgs)})" for name, ver, pkgs in siblings)
        )
    if do_import:
        try:
            import megatron.core  # noqa: F401  pylint: disable=import-outside-toplevel
            import megatron.training  # noqa: F401  pylint: disable=import-outside-toplevel

            report.append("import megatron.core, megatron.training: ok")
        except Exception as exc:  # pylint: disable=broad-except
            ok = False
            report.append(f"import failed: {type(exc).__name__}: {exc}")
    report.append("verify: OK" if ok else "verify: FAILED")
    return ok, report


def _no_manifest_reason(manifest_path):
    """Why there is no manifest: upstream's megatron-core replaced the fork, or no fork here."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and "+fork." not in dist.version:
        # e.g. `pip install --force-reinstall megatron-core==X` replaced the fork.
        return (
            f"megatron-core {dist.version} at {dist.locate_file('')} is upstream's, not the "
            "fork: it replaced or shadows the fork (run tools/install.sh again)"
        )
    return (
        f"no fork manifest at {manifest_path}: the fork is not installed here "
        "(run tools/install.sh, or pip install . after tools/fork.py materialize)"
    )


def _install_problems(manifest_path, manifest, core_dir, root):
    """Shadowing, a version other than the manifest's, and files that differ from it."""
    problems = []
    if root != manifest_path.resolve().parent.parent:
        problems.append(
            f"SHADOWED: megatron.core at {core_dir} is not the fork installed with "
            f"{manifest_path}; "
            "an upstream megatron-core (or another checkout) comes first on sys.path"
        )
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != manifest["version"]:
        problems.append(
            f"distribution megatron-core is {version!r}, "
            f"the manifest says {manifest['version']!r}: "
            "an upstream megatron-core is installed over or beside the fork"
        )
    for rel, digest in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            problems.append(f"missing {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"modified {rel}")
    shipped = {
        rel
        for rel in (p.relative_to(root).as_posix() for p in root.glob("megatron/**/*.py"))
        if rel.startswith(OWNED_PACKAGES)
    }
    problems += [f"unexpected {rel}" for rel in sorted(shipped - set(manifest["files"]))]
    leaked = [rel for rel in shipped if any(m in rel for m in TEST_ONLY_MARKERS)]
    problems += [f"test-only code shipped: {rel}" for rel in leaked]
    return problems


def _summary_line(manifest):
    base = manifest["base"]
    origin = (
        f"{base['wheel']}, sha256 {base['sha256'][:16]}..."
        if base.get("wheel")
        else f"Megatron-LM commit {str(base.get('commit'))[:12]}"
    )
    return (
        f"base megatron-core {base['name']} ({origin}), {len(manifest['files'])} files checked, "
        f"{len(manifest['patches'])} patches: " + ", ".join(p["name"] for p in manifest["patches"])
    )


def sibling_distributions(root):
    """Return (name, version, packages) of other installed distributions under ``megatron/``.

    Args:
        root: the site directory that holds the fork's ``megatron/``.
    """
    found = []
    for dist in importlib.metadata.distributions(path=[str(root)]):
        name = dist.metadata["Name"]
        if name is None or name.lower().replace("_", "-") == "megatron-core":
            continue
        pkgs = sorted(
            {
                "/".join(f.parts[:2])
                for f in dist.files or []
                if len(f.parts) > 2 and f.parts[0] == "megatron"
            }
        )
        if pkgs:
            found.append((name, dist.version, pkgs))
    return sorted(found)


def verify_parser(prog="megatron-fork-verify"):
    """The argument parser of verify (shared by ``megatron-fork-verify`` and ``fork.py verify``)."""
    import argparse  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Check the installed megatron-core fork against the manifest it shipped: "
        "every file's hash, the distribution version, test-only code, and which megatron.core "
        "is imported (an upstream copy that shadows the fork is named). Exit 0 ok, 1 failed.",
    )
    parser.add_argument("--manifest", default=None, help="manifest to check (default: installed)")
    parser.add_argument(
        "--import", dest="imports", action="store_true", help="also import megatron.core/training"
    )
    return parser


def main_verify(argv=None):
    """Console entry point ``megatron-fork-verify`` (also ``python -m megatron_fork.manifest``)."""
    args = verify_parser().parse_args(sys.argv[1:] if argv is None else argv)
    ok, report = verify(args.manifest, do_import=args.imports)
    sys.stdout.write("\n".join(report) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_verify())
