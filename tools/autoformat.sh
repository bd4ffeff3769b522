#!/usr/bin/env bash
# Format and lint gates of the fork, modelled on upstream Megatron-LM's own gates
# (black 24 with -l 100 --skip-string-normalization --skip-magic-trailing-comma, isort black
# profile, pylint's small enabled subset, ruff).
#
# Usage: tools/autoformat.sh [--check] [--python PY] [--tree DIR]
#   --check      report only; exit 1 on any finding (CI mode). Without it, fix what can be fixed.
#   --python PY  interpreter that has tools/lint-requirements.txt installed (default: $PYTHON,
#                else python3).
#   --tree DIR   directory holding the materialized megatron/ (default: the repository root).
#
# What it covers:
#   * the fork's own code: tools/, tests/ (minus tests/vendor/) and setup.py, whole files;
#   * in the materialized tree, only the files that patches/*.patch touch:
#       - files the series creates are ours: whole-file gates;
#       - upstream files the series modifies: black and isort whole-file when the pristine
#         upstream file already passes them, otherwise only where their diff meets a line the
#         series added or removed; pylint and ruff findings count only on lines the series added.
#     The pristine copy of each touched file is rebuilt by reverse-applying the series, so the
#     tree must be materialized from the current patches/ (python tools/fork.py materialize).
# No network access. Exit status: 0 clean (or fixed), 1 findings, 2 usage or setup error.
set -euo pipefail

REPO_ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." &>/dev/null && pwd)
CHECK=0
PY=${PYTHON:-python3}
TREE=$REPO_ROOT
while [[ $# -gt 0 ]]; do
    case "$1" in
        --check) CHECK=1 ;;
        --python) PY=$2; shift ;;
        --tree) TREE=$2; shift ;;
        -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "autoformat.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

for mod in black isort pylint ruff; do
    if ! "$PY" -c "import $mod" &>/dev/null; then
        echo "autoformat.sh: $PY lacks '$mod'; run: $PY -m pip install -r tools/lint-requirements.txt" >&2
        exit 2
    fi
done

cd "$REPO_ROOT"
exec "$PY" - "$CHECK" "$TREE" <<'PYEOF'
import os
import re
import shutil
import subprocess
import sys
import tempfile

CHECK = sys.argv[1] == "1"
TREE = os.path.abspath(sys.argv[2])
PY = sys.executable

BLACK = [PY, "-m", "black", "-q", "--line-length", "100", "--skip-string-normalization",
         "--skip-magic-trailing-comma", "--target-version", "py312"]
ISORT = [PY, "-m", "isort", "-q", "--profile", "black", "--line-length", "100",
         "--py", "312", "-p", "megatron", "-o", "transformer_engine"]
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
RUFF = [PY, "-m", "ruff", "check", "--isolated", "--quiet", "--line-length", "100",
        "--target-version", "py312", "--select", "F,E9,S506", "--ignore", "F841",
        "--per-file-ignores", "__init__.py:F401", "--output-format", "concise"]

findings = []


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def report(msg):
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
    out = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--",
               "tools", "tests", "setup.py"]).stdout.split()
    files = [f for f in out if f.endswith(".py") and not f.startswith("tests/vendor/")
             and os.path.exists(f)]
    return sorted(set(files))


def series_patches():
    if not os.path.isdir("patches"):
        return []
    names = []
    if os.path.exists("patches/series"):
        with open("patches/series") as fh:
            for line in fh:
                line = line.split("#", 1)[0].strip()
                if line:
                    names.append(os.path.join("patches", line.split()[0]))
    else:
        names = sorted(os.path.join("patches", n) for n in os.listdir("patches")
                       if n.endswith(".patch"))
    return [n for n in names if os.path.exists(n)]


def touched_files(patches):
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
                "the current series; run: python tools/fork.py materialize\n" + res.stderr)
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
    return run(tool + [check_flag(tool), path]).returncode == 0


def check_flag(tool):
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
    for line in output.splitlines():
        m = re.match(r"^(.*?):(\d+):(?:\d+:)?\s*(.*)$", line)
        if not m or os.path.abspath(m.group(1)) != os.path.abspath(path):
            continue
        if lines is None or int(m.group(2)) in lines:
            report(f"{label}:{m.group(2)}: {name}: {m.group(3)}")


def pylint_set(label):
    if label.startswith("tests/"):
        return PYLINT_TESTS
    if label.startswith("tools/") or label == "setup.py":
        return PYLINT_TOOLS
    return PYLINT_LIBRARY


def lint_all(jobs, tmp):
    """jobs: list of (path, label, lines, pristine_black, pristine_isort, fixable)."""
    for path, label, lines, p_black, p_isort, fixable in jobs:
        if not CHECK and fixable:
            run(ISORT + [path])
            run(BLACK + [path])
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
        out = run([PY, "-m", "pylint", f"--rcfile={rcfile}", f"--enable={enabled}",
                   "--msg-template={abspath}:{line}: {msg_id} ({symbol}) {msg}"]
                  + [j[0] for j in group]).stdout
        for path, label, lines, *_ in group:
            check_linter("pylint", out, path, label, lines)
    out = run(RUFF + ["--no-fix"] + [j[0] for j in jobs]).stdout
    for path, label, lines, *_ in jobs:
        check_linter("ruff", out, path, label, lines)


def main():
    own = own_files()
    jobs = [(f, f, None, True, True, True) for f in own]
    patches = series_patches()
    touched = [t for t in touched_files(patches) if t.endswith(".py")]
    if touched:
        if not os.path.isdir(os.path.join(TREE, "megatron")):
            sys.stderr.write(f"autoformat.sh: patches touch {len(touched)} Python files but "
                             f"{TREE}/megatron is missing; run: python tools/fork.py materialize\n")
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
                jobs.append((patched, path, lines, p_black, p_isort, fixable))
        lint_all(jobs, tmp)
    n_series = len(touched)
    print(f"autoformat.sh: {len(own)} fork files, {n_series} series-touched files, "
          f"{len(findings)} findings ({'check' if CHECK else 'fix'} mode)")
    if not CHECK and touched:
        print("autoformat.sh: fixes in megatron/ reach patches/ only through "
              "python tools/fork.py export")
    sys.exit(1 if findings else 0)


main()
PYEOF
