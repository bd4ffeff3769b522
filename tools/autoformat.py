"""Format and lint gates of the fork, modelled on upstream Megatron-LM's own gates.

Run through ``tools/autoformat.sh`` (which checks that the lint tools are installed); see its
header for what is covered. The series whose touched files are checked is the one of the base
the tree was materialized from, else the pin's default (tools/megatron_fork answers both).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from megatron_fork import ForkError, series, upstream  # noqa: E402  pylint: disable=C0413
from megatron_fork.workspace import Workspace  # noqa: E402  pylint: disable=C0413

CHECK = False
TREE = os.getcwd()
PY = sys.executable

BLACK = [
    PY,
    "-m",
    "black",
    "-q",
    "--line-length",
    "100",
    "--skip-string-normalization",
    "--skip-magic-trailing-comma",
    "--target-version",
    "py312",
]
ISORT = [
    PY,
    "-m",
    "isort",
    "-q",
    "--profile",
    "black",
    "--line-length",
    "100",
    "--py",
    "312",
    "-p",
    "megatron",
    "-o",
    "transformer_engine",
]
# Upstream's .pylintrc enables exactly C0115,C0116 (docstrings), W0611 (unused import),
# C0301 (line too long), E0606 (possibly used before assignment), W0141 (print in library code).
PYLINTRC = """[MAIN]
max-line-length=100
load-plugins=pylint.extensions.bad_builtin
persistent=no
score=no
[MESSAGES CONTROL]
disable=all
[BASIC]
bad-functions=print
"""
PYLINT_LIBRARY = "C0115,C0116,W0611,C0301,E0606,W0141"
PYLINT_TOOLS = "C0115,C0116,W0611,C0301,E0606"  # command-line scripts may print
PYLINT_TESTS = "W0611,C0301,E0606"  # upstream exempts tests; keep the cheap ones
RUFF = [
    PY,
    "-m",
    "ruff",
    "check",
    "--isolated",
    "--quiet",
    "--line-length",
    "100",
    "--target-version",
    "py312",
    "--select",
    "F,E9,S506",
    "--ignore",
    "F841",
    "--per-file-ignores",
    "__init__.py:F401",
    "--output-format",
    "concise",
]

findings = []


def run(cmd, **kw):
    """Run a command and capture its text output."""
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def report(msg):
    """Record and print one finding."""
    findings.append(msg)
    print(msg)


def hunks_meet(diff_text, lines):
    """True when a formatter's diff changes (removes, or inserts next to) one of `lines`.

    Context lines of a hunk do not count: upstream's own unformatted code next to a line the
    series added is not the series' finding.
    """
    changed, old_no = set(), 0
    for line in diff_text.splitlines():
        m = re.match(r"^@@ -(\d+)", line)
        if m:
            old_no = int(m.group(1))
        elif line.startswith("---") or line.startswith("+++"):
            continue
        elif line.startswith("-"):
            changed.add(old_no)
            old_no += 1
        elif line.startswith("+"):
            changed.update({old_no - 1, old_no})
        elif line.startswith(" "):
            old_no += 1
    return bool(changed & set(lines))


def own_files():
    """The fork's own Python files: tools/, tests/ minus vendor, setup.py, and the source files
    under megatron/ (what the patches create, tracked once; linted without a materialized tree)."""
    out = run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "--",
            "tools",
            "tests",
            "setup.py",
            "megatron",
        ]
    ).stdout.split()
    files = [
        f
        for f in out
        if f.endswith(".py") and not f.startswith("tests/vendor/") and os.path.exists(f)
    ]
    return sorted(set(files))


def tree_base(checkout):
    """The base TREE was materialized from, else the checkout's (its megatron/'s or the pin's)."""
    pin = upstream.load_pin(checkout.pin_file)
    return Workspace(Path(TREE)).base() or checkout.default_base(pin)


def series_patches():
    """The patch files of the tree's base, in series order (relative to the checkout)."""
    checkout = Workspace(Path(os.getcwd()))
    patch_dir = checkout.patch_dir(tree_base(checkout))
    if not (patch_dir / "series").exists():
        return []
    paths = [patch_dir / entry for entry in series.read_series(patch_dir)]
    return [os.path.relpath(p) for p in paths if p.exists()]


def touched_files(patches):
    """The paths the patches touch, in order of first appearance."""
    touched = []
    for p in patches:
        with open(p, errors="replace") as fh:
            for line in fh:
                if line.startswith("+++ b/"):
                    path = line[6:].rstrip("\n").split("\t")[0]
                    if path not in touched:
                        touched.append(path)
    return touched


def pristine_copies(patches, touched, tmp):
    """Copies the touched files from the tree and reverse-applies the series to them."""
    work = os.path.join(tmp, "pristine")
    os.makedirs(work)
    for path in touched:
        src = os.path.join(TREE, path)
        if os.path.exists(src):
            os.makedirs(os.path.dirname(os.path.join(work, path)) or work, exist_ok=True)
            shutil.copy2(src, os.path.join(work, path))
    for p in reversed(patches):
        res = run(["git", "apply", "-R", "--unidiff-zero", os.path.abspath(p)], cwd=work)
        if res.returncode != 0:
            sys.stderr.write(
                f"autoformat.sh: cannot reverse-apply {p} to {TREE}/megatron: the tree is not "
                "the current series; run: python tools/fork.py materialize\n" + res.stderr
            )
            sys.exit(2)
    return work


def series_lines(pristine, patched):
    """Line numbers of `patched` that the series added, plus neighbours of removed lines."""
    if pristine is None:
        return None  # whole file is ours
    res = run(["git", "diff", "--no-index", "-U0", "--", pristine, patched])
    lines = set()
    for m in re.finditer(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", res.stdout, re.M):
        start, count = int(m.group(1)), int(m.group(2) if m.group(2) is not None else 1)
        if count == 0:
            lines.update({start, start + 1})
        else:
            lines.update(range(start, start + count))
    return lines


def formatter_clean(tool, path):
    """True when the formatter would leave ``path`` unchanged."""
    return run(tool + [check_flag(tool), path]).returncode == 0


def check_flag(tool):
    """The report-only flag of a formatter."""
    return "--check-only" if tool is ISORT else "--check"


def check_formatter(name, tool, path, label, lines, pristine_clean):
    """black/isort gate for one file; lines=None means whole file."""
    whole = lines is None or pristine_clean
    res = run(tool + [check_flag(tool), "--diff", path])
    if res.returncode == 0:
        return
    if whole:
        report(f"{label}: {name} would reformat this file")
    elif hunks_meet(res.stdout, lines):
        report(f"{label}: {name} would reformat lines the series added")


def check_linter(name, output, path, label, lines):
    """Report the linter findings on ``path`` (on ``lines`` only, when given)."""
    for line in output.splitlines():
        m = re.match(r"^(.*?):(\d+):(?:\d+:)?\s*(.*)$", line)
        if not m or os.path.abspath(m.group(1)) != os.path.abspath(path):
            continue
        if lines is None or int(m.group(2)) in lines:
            report(f"{label}:{m.group(2)}: {name}: {m.group(3)}")


def pylint_set(label):
    """The pylint messages enabled for a file: library, tools or tests."""
    if label.startswith("tests/"):
        return PYLINT_TESTS
    if label.startswith("tools/") or label == "setup.py":
        return PYLINT_TOOLS
    return PYLINT_LIBRARY


def lint_all(jobs, tmp):
    """jobs: list of (path, label, lines, pristine_black, pristine_isort, fixable, ours)."""
    for path, label, lines, p_black, p_isort, fixable, ours in jobs:
        if not CHECK and fixable:
            run(ISORT + [path])
            run(BLACK + [path])
        if not CHECK and ours:
            # ruff counts only the series' lines of an upstream file; its whole-file fixes
            # (an unused upstream import, an upstream f-string) would drag upstream lines in.
            run(RUFF + ["--fix", path])
        check_formatter("isort", ISORT, path, label, lines, p_isort)
        check_formatter("black", BLACK, path, label, lines, p_black)
    if not jobs:
        return
    rcfile = os.path.join(tmp, "pylintrc")
    with open(rcfile, "w") as fh:
        fh.write(PYLINTRC)
    groups = {}
    for job in jobs:
        groups.setdefault(pylint_set(job[1]), []).append(job)
    for enabled, group in groups.items():
        out = run(
            [
                PY,
                "-m",
                "pylint",
                f"--rcfile={rcfile}",
                f"--enable={enabled}",
                "--msg-template={abspath}:{line}: {msg_id} ({symbol}) {msg}",
            ]
            + [j[0] for j in group]
        ).stdout
        for path, label, lines, *_ in group:
            check_linter("pylint", out, path, label, lines)
    out = run(RUFF + ["--no-fix"] + [j[0] for j in jobs]).stdout
    for path, label, lines, *_ in jobs:
        check_linter("ruff", out, path, label, lines)


def main(argv=None):
    """Run the gates; exit 0 clean (or fixed), 1 findings, 2 setup error."""
    global CHECK, TREE  # pylint: disable=global-statement
    parser = argparse.ArgumentParser(prog="tools/autoformat.sh")
    parser.add_argument("--check", action="store_true", help="report only; exit 1 on findings")
    parser.add_argument("--tree", default=os.getcwd(), help="directory holding megatron/")
    args = parser.parse_args(argv)
    CHECK, TREE = args.check, os.path.abspath(args.tree)
    own = own_files()
    jobs = [(f, f, None, True, True, True, True) for f in own]
    try:
        patches = series_patches()
    except ForkError as exc:
        sys.stderr.write(f"autoformat.sh: {exc}\n")
        sys.exit(2)
    touched = [t for t in touched_files(patches) if t.endswith(".py") and t not in own]
    if touched:
        if not os.path.isdir(os.path.join(TREE, "megatron")):
            sys.stderr.write(
                f"autoformat.sh: patches touch {len(touched)} Python files but "
                f"{TREE}/megatron is missing; run: python tools/fork.py materialize\n"
            )
            sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        if touched:
            work = pristine_copies(patches, touched_files(patches), tmp)
            for path in touched:
                patched = os.path.join(TREE, path)
                if not os.path.exists(patched):
                    continue  # the series deletes it
                pristine = os.path.join(work, path)
                if not os.path.exists(pristine) or os.path.getsize(pristine) == 0:
                    pristine = None
                lines = series_lines(pristine, patched)
                p_black = pristine is None or formatter_clean(BLACK, pristine)
                p_isort = pristine is None or formatter_clean(ISORT, pristine)
                # Fixing an upstream file that was not clean would drag upstream lines into
                # the series; only fix files whose whole content is held to the gates.
                fixable = p_black and p_isort
                jobs.append((patched, path, lines, p_black, p_isort, fixable, pristine is None))
        lint_all(jobs, tmp)
    n_series = len(touched)
    print(
        f"autoformat.sh: {len(own)} fork files, {n_series} series-touched files, "
        f"{len(findings)} findings ({'check' if CHECK else 'fix'} mode)"
    )
    if not CHECK and touched:
        print(
            "autoformat.sh: fixes in megatron/ reach patches/ only through "
            "python tools/fork.py export"
        )
    sys.exit(1 if findings else 0)


if __name__ == "__main__":
    main()
