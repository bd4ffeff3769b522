"""Command line of the fork tooling. Run ``tools/fork.py --help``.

Exit codes:
    0  success
    1  a check, verify or test expectation failed
    2  usage error or bad input file (series, pin, unknown base)
    3  a wheel's sha256 does not match the pin
    4  upstream could not be obtained (offline without cache, missing checkout)
    5  a patch did not apply with zero fuzz and zero offset (patch, file and hunk are printed)
    6  megatron/ holds unexported work; nothing was changed
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from . import EXIT_FAILED, EXIT_OK, ForkError
from . import manifest as manifest_mod
from . import queue as queue_mod
from . import series as series_mod
from . import status as status_mod
from . import upstream

DEFAULT_STATUS_BASES = ("0.17.1", "0.18.2", "0.19.2", "dev")


def _source_args(p):
    p.add_argument("--wheel", help="use this local wheel file (verified against the pin)")
    p.add_argument("--wheel-dir", help="directory of pre-downloaded wheels")
    p.add_argument("--offline", action="store_true", help="never use the network")
    p.add_argument("--git-repo", help="read upstream from this local Megatron-LM checkout")
    p.add_argument("--rev", help="revision of --git-repo (default: the base's git tag)")


def _source(args):
    return {
        "wheel": args.wheel,
        "wheel_dir": args.wheel_dir,
        "offline": args.offline,
        "git_repo": getattr(args, "git_repo", None),
        "rev": getattr(args, "rev", None),
    }


def cmd_fetch(args, pin):
    """Download (or find) and hash-verify the pinned wheel."""
    path = upstream.fetch_wheel(pin, args.base, args.wheel, args.wheel_dir, args.offline)
    print(f"{path} (sha256 verified)")


def cmd_pristine(args, pin):
    """Materialize a pristine base (no patches) under build/trees/pristine-<base>."""
    dest = Path(args.dest) if args.dest else queue_mod.BUILD / "trees" / f"pristine-{args.base}"
    if (dest / "megatron").exists() and not args.force:
        print(f"{dest} exists")
        return
    queue_mod.materialize(pin, args.base, dest_tree=dest, **_source(args))
    print(f"pristine megatron-core {args.base} at {dest}")


def cmd_materialize(args, pin):
    """Build megatron/ = upstream + series, atomically."""
    if args.if_stale and queue_mod.is_current():
        print("megatron/ is current (materialized from patches/ as they are; no edits)")
        return
    hook = args.test_interrupt_after
    applied = queue_mod.materialize(
        pin, args.base, force=args.force, interrupt_after=hook, **_source(args)
    )
    print(f"megatron/ = megatron-core {args.base} + {len(applied)} patches")
    for name in applied:
        print(f"  applied {name}")


def cmd_export(args, pin):
    """Regenerate patches/ from the queue's commits."""
    written, removed = queue_mod.export()
    if not written and not removed:
        print("patches/ is up to date (no byte changed)")
    for name in written:
        print(f"  wrote {name}")
    for name in removed:
        print(f"  removed {name}")


def cmd_commit(args, pin):
    """Record edits in megatron/ into a queue commit."""
    queue_mod.commit(to=args.to, new=args.new, message_file=args.message_file)
    print("committed; run `tools/fork.py export` to write patches/")


def cmd_check(args, pin):
    """Series and files 1:1, the series applies cleanly, and export is idempotent."""
    failures = []
    missing, extra = series_mod.series_mismatch()
    failures += [f"patches/series lists {n}, which does not exist" for n in missing]
    failures += [f"patches/{n} is not listed in patches/series" for n in extra]
    if not missing:
        patches = series_mod.load_series()
        for patch in patches:
            for req in patch.requires:
                names = [p.name for p in patches]
                if req not in names or names.index(req) > names.index(patch.name):
                    failures.append(f"{patch.name} requires {req}, which is not earlier in series")
            if not patch.upstream_status:
                failures.append(f"{patch.name} has no Upstream-Status trailer")
    if failures:
        raise ForkError("check failed:\n  " + "\n  ".join(failures), EXIT_FAILED)
    with tempfile.TemporaryDirectory(prefix="fork-check-") as tmp:
        # Apply into a private queue so the developer's megatron/ is never touched.
        saved = (queue_mod.TREE, queue_mod.PQ)
        queue_mod.TREE, queue_mod.PQ = Path(tmp) / "megatron", Path(tmp) / ".pq"
        try:
            queue_mod.materialize(pin, pin["primary"]["name"], force=True, **_source(args))
            rendered = queue_mod.render_patches()
        finally:
            queue_mod.TREE, queue_mod.PQ = saved
    drift = [n for n, t in rendered.items() if (series_mod.PATCH_DIR / n).read_text() != t]
    if list(rendered) != series_mod.read_series():
        drift.append("series")
    if drift:
        raise ForkError(
            "check failed: export is not idempotent for "
            + ", ".join(drift)
            + " (run materialize + export and commit the result)",
            EXIT_FAILED,
        )
    print(f"check: OK ({len(rendered)} patches apply with zero fuzz/offset; export idempotent)")


def cmd_status(args, pin):
    """Print the patch x base matrix."""
    names = args.base or list(DEFAULT_STATUS_BASES)
    source = {"wheel_dir": args.wheel_dir, "offline": args.offline}
    patches, matrix, am3 = status_mod.status(pin, names, args.git_repo, args.am3, source)
    print(status_mod.render(patches, matrix, am3))
    if "dev" in names and not args.git_repo:
        print("\n(dev skipped: pass --git-repo PATH-TO-Megatron-LM to check the cherry-pick base)")
    warnings = status_mod.metadata_warnings(patches, matrix)
    if warnings:
        print("\nmetadata:\n  " + "\n  ".join(warnings))
    if args.json:
        data = {c: {p: {"outcome": o, "detail": d} for p, (o, d) in cells.items()}
                for c, cells in matrix.items()}  # fmt: skip
        Path(args.json).write_text(json.dumps({"matrix": data, "am3": am3}, indent=2) + "\n")


def cmd_verify(args, pin):
    """Check the installed fork against its manifest."""
    ok, report = manifest_mod.verify(args.manifest, do_import=args.imports)
    print("\n".join(report))
    if not ok:
        raise ForkError("verify failed", EXIT_FAILED)


def build_parser():
    """Return the argparse parser of the CLI."""
    parser = argparse.ArgumentParser(
        prog="tools/fork.py",
        description="Pinned upstream + patch series for the megatron-core fork.",
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pin", default=str(upstream.PIN_FILE), help="the upstream pin file")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download/verify the pinned wheel into the cache")
    p.add_argument("--base", default=None)
    p.add_argument("--wheel")
    p.add_argument("--wheel-dir")
    p.add_argument("--offline", action="store_true")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("pristine", help="materialize an unpatched base for test arms")
    p.add_argument("base")
    p.add_argument("--dest")
    p.add_argument("--force", action="store_true")
    _source_args(p)
    p.set_defaults(func=cmd_pristine)

    p = sub.add_parser("materialize", help="megatron/ = upstream + patches/series (atomic)")
    p.add_argument("--base", default=None)
    p.add_argument("--force", action="store_true", help="discard unexported work in megatron/")
    p.add_argument("--if-stale", action="store_true", help="do nothing if already current")
    p.add_argument("--test-interrupt-after", type=int, default=None, help=argparse.SUPPRESS)
    _source_args(p)
    p.set_defaults(func=cmd_materialize)

    p = sub.add_parser("export", help="regenerate patches/ from the queue commits in .pq")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("commit", help="record megatron/ edits into the patch queue")
    p.add_argument("--to", help="fold the edits into this patch (file name)")
    p.add_argument("--new", help="start a new patch with this subject")
    p.add_argument("--message-file", help="body of the new patch's message")
    p.set_defaults(func=cmd_commit)

    p = sub.add_parser("check", help="series<->files, clean apply, idempotent export")
    _source_args(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("status", help="matrix of every patch against every base")
    p.add_argument("--base", action="append", help="a base (repeatable); default: all")
    p.add_argument("--git-repo", help="local Megatron-LM clone for the git bases (dev)")
    p.add_argument("--am3", action="store_true", help="also try `git am -3` on the dev commit")
    p.add_argument("--wheel-dir")
    p.add_argument("--offline", action="store_true")
    p.add_argument("--json", help="also write the matrix as JSON to this file")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("verify", help="check the installed fork against its manifest")
    p.add_argument("--manifest", default=None)
    p.add_argument("--import", dest="imports", action="store_true")
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv=None):
    """Run the CLI and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        pin = upstream.load_pin(args.pin) if args.command != "verify" else None
        if pin is not None and getattr(args, "base", None) is None and args.command in (
            "fetch", "materialize",
        ):  # fmt: skip
            args.base = pin["primary"]["name"]
        args.func(args, pin)
    except ForkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}; megatron/ was left as it was", file=sys.stderr)
        return 130
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
