"""Command line of the fork tooling. Run ``tools/fork.py --help``.

Exit codes:
    0  success
    1  a check, verify or test expectation failed
    2  usage error or bad input file (series, pin, unknown base)
    3  a wheel's sha256 does not match the pin
    4  upstream could not be obtained (offline without cache, missing checkout)
    5  a patch did not apply with zero fuzz and zero offset, or is incomplete (patch, file and
       hunk are printed)
    6  megatron/ holds unexported work; nothing was changed
    7  another run holds the workspace lock (build/.materialize.lock)
    8  rebase stopped at a conflict (patch, file and hunk printed); resolve, then --continue
    9  I/O fault (no space, read-only, permission, cross-device rename, corrupt archive)
  130  interrupted by SIGINT; 143 terminated by SIGTERM (the tree is left as it was)
"""

import argparse
import json
import signal
import sys
from pathlib import Path

from . import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, EXIT_UNAVAILABLE, ForkError
from . import check as check_mod
from . import manifest as manifest_mod
from . import queue as queue_mod
from . import rebase as rebase_mod
from . import records as records_mod
from . import series as series_mod
from . import status as status_mod
from . import upstream
from .workspace import Workspace


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


def _default_base(args, pin, ws):
    """--base, else the base megatron/ was built on, else the pin's default (newest release)."""
    return args.base or ws.default_base(pin)


def _named_bases(args):
    """The base names given on the command line (``--base``, and ``pristine``'s positional)."""
    given = getattr(args, "base", None)
    if given is None:
        return []
    return [given] if isinstance(given, str) else list(given)


def _source_for(args, pin, base, several=False):
    """The upstream source of ``base``: a checkout is used for git bases, or when asked alone."""
    source = _source(args)
    if several and not upstream.is_git_base(pin, base):
        source.update(git_repo=None, rev=None)
    return source


def cmd_fetch(args, pin, ws):
    """Download (or find) and hash-verify the pinned wheels; with --dest, copy them there."""
    dest = args.dest or args.wheel_dir  # --wheel-dir is filled when the wheel is not there yet
    for base in args.base or [pin["default"]]:
        path = upstream.fetch_wheel(pin, base, args.wheel, args.wheel_dir, args.offline)
        if dest:
            path = upstream.copy_wheel(path, dest)
        print(f"{path} (sha256 verified)")


def cmd_pristine(args, pin, ws):
    """Materialize a pristine base (no patches) under build/trees/pristine-<base>."""
    dest = Path(args.dest) if args.dest else ws.build / "trees" / f"pristine-{args.base}"
    if (dest / "megatron").exists() and not args.force:
        print(f"{dest} exists")
        return
    queue_mod.materialize(pin, args.base, ws=ws, dest_tree=dest, **_source(args))
    print(f"pristine megatron-core {args.base} at {dest}")


def cmd_materialize(args, pin, ws):
    """Build megatron/ = upstream + the base's series, atomically."""
    base = _default_base(args, pin, ws)
    if args.dest:
        applied = queue_mod.materialize(
            pin, base, ws=ws, dest_tree=Path(args.dest), with_series=True, **_source(args)
        )
        print(f"{args.dest}/megatron = megatron-core {base} + {len(applied)} patches (no queue)")
        return
    if args.if_stale and queue_mod.is_current(ws, base):
        print(f"megatron/ is current (base {base}, materialized from patches/{base}; no edits)")
        return
    applied = queue_mod.materialize(pin, base, ws=ws, force=args.force, **_source(args))
    print(f"megatron/ = megatron-core {base} + {len(applied)} patches (patches/{base}/series)")
    for name in applied:
        print(f"  applied {name}")


def cmd_export(args, pin, ws):
    """Regenerate patches/<base>/ from the queue's commits and the fork's source files."""
    written, removed = queue_mod.export(ws)
    if not written and not removed:
        base = ws.base()
        print(f"patches/{base + '/' if base else ''} is up to date (no byte changed)")
    for name in written:
        print(f"  wrote {name}")
    for name in removed:
        print(f"  removed {name}")


def cmd_commit(args, pin, ws):
    """Record edits in megatron/ into a queue commit."""
    queue_mod.commit(ws, to=args.to, new=args.new, message_file=args.message_file)
    print("committed; run `tools/fork.py export` to write patches/")


def cmd_check(args, pin, ws):
    """Each base's series: consistent metadata, clean apply, idempotent export."""
    bases = args.base or list(pin["maintained"])
    skipped = []
    for base in bases:
        if base not in pin["maintained"]:
            raise ForkError(f"{base} is not a maintained base ({', '.join(pin['maintained'])})", 2)
        if upstream.is_git_base(pin, base) and not args.git_repo:
            if (ws.patch_dir(base) / "series").is_file():
                check_mod.check_metadata(pin, base, ws)  # what needs no upstream tree, still
            if args.base:
                raise ForkError(f"check --base {base} needs --git-repo PATH-TO-Megatron-LM", 4)
            skipped.append(base)
            continue
        source = _source_for(args, pin, base, several=len(bases) > 1)
        print(check_mod.check_base(pin, base, ws, source), flush=True)
    if skipped:
        # A check that left a maintained base out must not pass as a check of every base.
        raise ForkError(
            f"check {', '.join(skipped)}: not checked (Megatron-LM commit; pass --git-repo "
            "PATH-TO-Megatron-LM, or name the bases to check with --base)",
            EXIT_UNAVAILABLE,
        )


def cmd_records(args, pin, ws):
    """Compare (or with --write, rewrite) what the change records generate."""
    if args.write:
        written = records_mod.write(ws.patch_root, pin)
        for path in written:
            print(f"  wrote {path}")
        if not written:
            print("every generated file agrees with the change records (no byte changed)")
        return
    drift = records_mod.plan(ws.patch_root, pin).drift()
    if drift:
        raise ForkError(
            f"{len(drift)} file(s) disagree with patches/{records_mod.CHANGES_FILE}: "
            + ", ".join(drift)
            + " (run `tools/fork.py records --write`)",
            EXIT_FAILED,
        )
    print("every generated file agrees with the change records")


def cmd_tests(args, pin, ws):
    """Print the counterfactual test files named by the change records, one a line (scripts)."""
    for path in records_mod.counterfactual_files(records_mod.load(ws.patch_root)):
        print(path)


def cmd_status(args, pin, ws):
    """Print the change x base matrix."""
    names = args.base or ([] if args.rev else list(status_mod.DEFAULT_BASES))
    source = {"wheel_dir": args.wheel_dir, "offline": args.offline}
    result = status_mod.status(
        pin, ws, names, args.rev or [], args.git_repo, args.am3, source, args.series
    )
    print(result.render())
    if result.skipped:
        print(
            f"\n({', '.join(result.skipped)} skipped: pass --git-repo PATH-TO-Megatron-LM to "
            "check git bases and refs)"
        )
    warnings = result.metadata_warnings()
    if warnings:
        print("\nmetadata:\n  " + "\n  ".join(warnings))
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_json(), indent=2) + "\n")


def cmd_rebase(args, pin, ws):
    """Carry a base's series onto a new upstream with git, patch by patch."""
    if args.abort:
        print(rebase_mod.abort(ws))
        return
    if args.cont:
        print(rebase_mod.cont(pin, ws))
        return
    if not args.base or not args.onto:
        raise ForkError("rebase needs --base B --onto TARGET (or --continue / --abort)", 2)
    print(rebase_mod.start(pin, ws, args.base, args.onto, args.git_repo, args.name, _source(args)))


def cmd_base(args, pin, ws):
    """Print a base name for scripts (tools/install.sh, tools/test.sh, tools/maint/)."""
    if args.releases:
        print(" ".join(upstream.releases(pin)))
    elif args.default:
        print(pin["default"])
    elif args.materialized:
        if ws.base() is None:
            raise ForkError(
                f"{ws.tree} is not materialized: run `tools/fork.py materialize`", EXIT_FAILED
            )
        print(ws.base())
    else:
        print(ws.default_base(pin))


def cmd_series(args, pin, ws):
    """Print the entries of a base's series, one a line."""
    for entry in series_mod.read_series(ws.patch_dir(_default_base(args, pin, ws))):
        print(entry)


def cmd_verify(args, pin, ws):
    """Check the installed fork against its manifest."""
    ok, report = manifest_mod.verify(args.manifest, do_import=args.imports)
    print("\n".join(report))
    if not ok:
        raise ForkError("verify failed", EXIT_FAILED)


def build_parser(ws):
    """Return the argparse parser of the CLI for the workspace ``ws``."""
    parser = argparse.ArgumentParser(
        prog="tools/fork.py",
        description="Pinned upstream + patch series for the megatron-core fork.",
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pin", default=str(ws.pin_file), help="the upstream pin file")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download/verify pinned wheels into the cache (or --dest)")
    p.add_argument("--base", action="append", help="a wheel base (repeatable; default: default)")
    p.add_argument("--dest", help="also copy the verified wheels into this folder (offline kit)")
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

    p = sub.add_parser("materialize", help="megatron/ = upstream + patches/<base>/series (atomic)")
    p.add_argument("--base", help="the base (default: megatron/'s base, else the pin's default)")
    p.add_argument("--dest", help="build upstream + series at DEST/megatron, without a queue")
    p.add_argument("--force", action="store_true", help="discard unexported work in megatron/")
    p.add_argument("--if-stale", action="store_true", help="do nothing if already current")
    _source_args(p)
    p.set_defaults(func=cmd_materialize)

    p = sub.add_parser("export", help="regenerate patches/ from the queue commits in .pq")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("commit", help="record megatron/ edits into the patch queue")
    p.add_argument("--to", help="fold the edits into this patch (file name)")
    p.add_argument("--new", help="start a new patch with this subject")
    p.add_argument("--message-file", help="body of the new patch's message")
    p.set_defaults(func=cmd_commit)

    p = sub.add_parser("check", help="series<->files, clean apply, idempotent export, per base")
    p.add_argument("--base", action="append", help="a maintained base (repeatable; default: all)")
    _source_args(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "records",
        help="docs/changes.md, the README's count, tests/README.md and patch trailers against "
        "patches/changes.toml",
    )
    p.add_argument("--write", action="store_true", help="rewrite the files that disagree")
    p.set_defaults(func=cmd_records)

    p = sub.add_parser("tests", help="the counterfactual test files of the change records")
    p.set_defaults(func=cmd_tests)

    p = sub.add_parser("status", help="matrix of every change against every base or ref")
    p.add_argument("--base", action="append", help="a pinned base (repeatable); default: all")
    p.add_argument("--rev", action="append", help="any ref of --git-repo (repeatable)")
    p.add_argument("--series", help="the maintained series to try on --rev refs (default: dev)")
    p.add_argument("--git-repo", help="local Megatron-LM clone for git bases and --rev refs")
    p.add_argument("--am3", action="store_true", help="also try `git am -3` on each git column")
    p.add_argument("--wheel-dir")
    p.add_argument("--offline", action="store_true")
    p.add_argument("--json", help="also write the matrix as JSON to this file")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("rebase", help="carry a base's series onto a new upstream (git)")
    p.add_argument("--base", help="the maintained base whose series is carried")
    p.add_argument("--onto", help="a release version of the pin, or a git ref of --git-repo")
    p.add_argument("--name", help="the base name to write (default: the version or ref)")
    p.add_argument("--continue", dest="cont", action="store_true", help="after resolving")
    p.add_argument("--abort", action="store_true", help="drop the rebase in progress")
    _source_args(p)
    p.set_defaults(func=cmd_rebase)

    p = sub.add_parser("base", help="print megatron/'s base, else the pin's default (scripts)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--default", action="store_true", help="the pin's default (newest release)")
    which.add_argument(
        "--materialized", action="store_true", help="megatron/'s base; exit 1 when there is none"
    )
    which.add_argument(
        "--releases", action="store_true", help="the maintained releases (wheels), on one line"
    )
    p.set_defaults(func=cmd_base)

    p = sub.add_parser("series", help="print a base's series entries, one a line (scripts)")
    p.add_argument("--base", help="the base (default: megatron/'s base, else the pin's default)")
    p.set_defaults(func=cmd_series)

    p = sub.add_parser("verify", help="check the installed fork against its manifest")
    p.add_argument("--manifest", default=None)
    p.add_argument("--import", dest="imports", action="store_true")
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv=None, ws=None):
    """Run the CLI and return its exit code.

    Args:
        argv: the arguments (default: the process's).
        ws: the workspace (default: the checkout this tool lives in, ``tools/..``).
    """
    ws = ws or Workspace(Path(__file__).resolve().parents[2])
    parser = build_parser(ws)
    args = parser.parse_args(argv)
    try:
        pin = upstream.load_pin(args.pin) if args.command != "verify" else None
        for name in _named_bases(args):
            upstream.base_entry(pin, name)  # an unknown base is named before anything runs
        args.func(args, pin, ws)
    except ForkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except (KeyboardInterrupt, queue_mod.Interrupted) as exc:
        code = EXIT_SIGTERM if getattr(exc, "signum", None) == signal.SIGTERM else EXIT_SIGINT
        print(f"interrupted ({exc}); megatron/ was left as it was", file=sys.stderr)
        return code
    except OSError as exc:
        err = queue_mod.io_error(exc, f"tools/fork.py {args.command}")
        print(f"error: {err}", file=sys.stderr)
        return err.code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
