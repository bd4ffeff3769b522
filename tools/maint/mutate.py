#!/usr/bin/env python3
"""Mutation runner: break each fix on purpose and check that the suite notices.

Reads every ``*.toml`` in tools/maint/mutations/ (one file per patch, e.g. ``0002.toml``), each
a list of ``[[mutation]]`` tables:

    id = "0002-guard-off-by-one"          # unique over all files
    file = "megatron/core/distributed/param_and_grad_buffer.py"   # in the materialized tree
    old = '''text that occurs exactly once in that file'''
    new = '''replacement text'''
    tests = ["tests/test_ddp_calibration.py::test_x"]   # pytest node ids or files
    why = "which break of the fix this is"

Each mutation is applied alone to the materialized tree, its tests run with pytest, and the file
is restored (byte for byte, with its mtime, also on Ctrl-C or SIGTERM). A mutation is KILLED when
pytest reports failures (exit 1), SURVIVED when pytest passes, ERROR on any other pytest exit
(interrupted, usage, no tests collected). Bytecode of the mutated file is removed before and after
each run, and the runs do not write any, so a stale .pyc never stands in for a mutant.

Usage:
    tools/maint/mutate.py [--only ID ...] [--patch 0002 ...] [--list] [--json OUT]
                          [--tree DIR] [--mutations DIR] [--python PY] [-- PYTEST_ARGS...]

Exit status: 0 every selected mutation killed; 1 some survived or errored; 2 bad input (a
malformed spec, an unknown id, an ``old`` text that does not occur exactly once: the id is
named); 130 interrupted (the file is restored first).
"""

import argparse
import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MUTATIONS = Path(__file__).resolve().parent / 'mutations'
REQUIRED = ('id', 'file', 'old', 'new', 'tests', 'why')
# pytest's output as one text stream, in a session of its own (a signal reaches its workers too).
PYTEST_OUTPUT = {
    'stdout': subprocess.PIPE,
    'stderr': subprocess.STDOUT,
    'text': True,
    'start_new_session': True,
}


class SpecError(Exception):
    """A mutation spec that cannot be applied as written (exit 2)."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; the runner restores the file and exits 130."""


def load(mutations_dir, patches=(), only=()):
    """Read, validate and select mutations.

    Args:
        mutations_dir: folder with ``<patch>.toml`` files.
        patches: keep only these patch numbers (file stems); empty keeps all.
        only: keep only these ids; empty keeps all.

    Returns:
        list of dicts (spec fields plus ``patch``), in file then entry order.
    """
    out, seen = [], set()
    files = sorted(Path(mutations_dir).glob('*.toml'))
    if not files:
        raise SpecError(f'no mutation files in {mutations_dir}')
    for path in files:
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f'{path.name}: {exc}') from None
        for index, entry in enumerate(data.get('mutation', [])):
            missing = [k for k in REQUIRED if k not in entry]
            name = entry.get('id', f'{path.name}[{index}]')
            if missing:
                raise SpecError(f'{name}: missing {", ".join(missing)}')
            if name in seen:
                raise SpecError(f'{name}: duplicate id')
            if not isinstance(entry['tests'], list) or not entry['tests']:
                raise SpecError(f'{name}: tests must be a non-empty list')
            if entry['old'] == entry['new']:
                raise SpecError(f'{name}: old and new are the same text')
            seen.add(name)
            out.append({**entry, 'patch': path.stem})
    unknown = [i for i in only if i not in seen]
    if unknown:
        raise SpecError(f'unknown mutation id: {", ".join(unknown)}')
    known_patches = {m['patch'] for m in out}
    unknown = [p for p in patches if p not in known_patches]
    if unknown:
        raise SpecError(f'no mutation file for patch: {", ".join(unknown)}')
    return [
        m for m in out if (not patches or m['patch'] in patches) and (not only or m['id'] in only)
    ]


def check_applicable(mutation, tree):
    """Raise SpecError unless ``old`` occurs exactly once in the mutation's file."""
    path = Path(tree) / mutation['file']
    if not path.is_file():
        raise SpecError(f'{mutation["id"]}: {mutation["file"]} not found under {tree}')
    count = path.read_text().count(mutation['old'])
    if count != 1:
        raise SpecError(
            f'{mutation["id"]}: old text occurs {count} times in {mutation["file"]} '
            '(must be exactly once)'
        )


def check_tree_is_tested(tree):
    """Raise SpecError when the tests would import another tree than ``tree``: for the base that
    the repository's megatron/ is materialized from, the harness uses the repository itself
    (tests/harness/launcher.py), so mutating build/trees/fork-<base> would change nothing."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        from tests.harness import bases  # pylint: disable=import-outside-toplevel
    except RuntimeError as exc:  # FORK_TEST_BASE names no maintained base
        raise SpecError(str(exc)) from None
    base = bases.BASE
    if bases.WORKSPACE.base() == base:
        trees = REPO / 'build' / 'trees'
        if trees in Path(tree).resolve().parents:
            raise SpecError(
                f'--tree {tree}: the tests of base {base} import {REPO}/megatron (materialized '
                'from that base), not this tree; pass --tree . or materialize another base'
            )


def _drop_bytecode(path):
    """Remove the cached bytecode of a source file (every optimisation level)."""
    for level in ('', 1, 2):
        try:
            os.unlink(importlib.util.cache_from_source(str(path), optimization=level))
        except FileNotFoundError:
            pass


def _failures(output):
    """The node ids pytest reports as FAILED or ERROR, in order."""
    return re.findall(r'^(?:FAILED|ERROR) (\S+)', output, flags=re.M)


def run_one(mutation, tree, python, pytest_args, stream=None):
    """Apply one mutation, run its tests, restore the file.

    Returns:
        dict: id, patch, status (KILLED / SURVIVED / ERROR), pytest exit code, seconds and the
        failing node ids.
    """
    path = Path(tree) / mutation['file']
    original = path.read_bytes()
    stat = path.stat()
    digest = hashlib.sha256(original).hexdigest()
    mutated = original.decode().replace(mutation['old'], mutation['new'], 1).encode()
    cmd = [python, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider', '-rfE']
    cmd += list(pytest_args) + list(mutation['tests'])
    env = {**os.environ, 'PYTHONDONTWRITEBYTECODE': '1'}
    start = time.monotonic()
    proc = None
    try:
        _drop_bytecode(path)
        path.write_bytes(mutated)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, **PYTEST_OUTPUT)
        output = []
        for line in proc.stdout:
            output.append(line)
            if stream is not None:
                stream.write(line)
        rc = proc.wait()
    finally:
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        _drop_bytecode(path)
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise RuntimeError(f'{path} was not restored')
    status = {0: 'SURVIVED', 1: 'KILLED'}.get(rc, 'ERROR')
    return {
        'id': mutation['id'],
        'patch': mutation['patch'],
        'status': status,
        'pytest_rc': rc,
        'seconds': round(time.monotonic() - start, 1),
        'failed': _failures(''.join(output)),
        'tests': mutation['tests'],
        'why': mutation['why'],
    }


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def main(argv=None):
    """Command line entry point; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description='Apply each mutation of the fix to megatron/, run its tests, restore.',
        epilog='Exit: 0 all killed, 1 a mutation survived or errored, 2 bad spec, 130 interrupted.',
    )
    parser.add_argument('--only', action='append', default=[], metavar='ID')
    parser.add_argument('--patch', action='append', default=[], metavar='NNNN')
    parser.add_argument('--list', action='store_true', help='list the selected mutations')
    parser.add_argument('--json', metavar='OUT', help='write per-mutation results here')
    parser.add_argument('--tree', default=str(REPO), help='folder holding megatron/')
    parser.add_argument('--mutations', default=str(MUTATIONS), help='folder of *.toml specs')
    parser.add_argument('--python', default=sys.executable, help='interpreter running pytest')
    parser.add_argument('--quiet', action='store_true', help='do not echo pytest output')
    parser.add_argument('pytest_args', nargs='*', help='extra pytest arguments (after --)')
    args = parser.parse_args(argv)

    try:
        check_tree_is_tested(args.tree)
        selected = load(args.mutations, args.patch, args.only)
        for mutation in selected:
            check_applicable(mutation, args.tree)
    except SpecError as exc:
        print(f'mutate: {exc}', file=sys.stderr)
        return 2
    if args.list:
        for m in selected:
            print(f'{m["id"]}\t{m["file"]}\t{" ".join(m["tests"])}\t{m["why"]}')
        return 0

    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    results = []
    try:
        for mutation in selected:
            print(f'== {mutation["id"]}: {mutation["why"]}', flush=True)
            res = run_one(
                mutation,
                args.tree,
                args.python,
                args.pytest_args,
                stream=None if args.quiet else sys.stdout,
            )
            results.append(res)
            detail = f' by {res["failed"][0]}' if res['failed'] else f' (pytest {res["pytest_rc"]})'
            print(f'{res["status"]} {res["id"]} in {res["seconds"]} s{detail}', flush=True)
    except Interrupted as exc:
        print(f'mutate: interrupted ({exc}); the mutated file was restored', file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    killed = sum(r['status'] == 'KILLED' for r in results)
    print()
    for r in results:
        print(f'{r["status"]:9} {r["id"]}')
    print(f'killed/total: {killed}/{len(results)}')
    if args.json:
        Path(args.json).write_text(
            json.dumps({'killed': killed, 'total': len(results), 'results': results}, indent=1)
            + '\n'
        )
    return 0 if killed == len(results) else 1


if __name__ == '__main__':
    sys.exit(main())
