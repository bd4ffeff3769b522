#!/usr/bin/env python3
"""Check the fork wheel of one base against the torch release a venv holds; record the result.

    tools/compat.py torch --venv VENV [--base BASE] [--out FILE]

Installs the fork of BASE (default: the default base) into VENV with ``tools/install.sh`` (which
keeps VENV's torch), runs ``megatron-fork-verify --import`` there, then the base's counterfactual
test files (``tools/fork.py tests``: every pristine and fork arm) with VENV's python, and writes
one JSON record: the fork's version, torch's, pytest's counts, the commit and the date. Default
FILE: tests/evidence/data/compat/torch-<base>-<torch>.json, which the README's compatibility
matrix is rendered from (``tools/fork.py records --write``; tools/megatron_fork/compat.py).

It materializes megatron/ for BASE in this checkout: run it in a clone of its own
(``git clone . ../compat && ../compat/tools/compat.py torch ...``).

Exit status: 0 when verify passed and no test failed; 1 when either failed (the record is still
written); 2 on bad arguments.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _out(cmd, **kw):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, **kw)


def _counts(text):
    """pytest's closing counts {'passed': N, 'failed': N, 'skipped': N, 'errors': N}."""
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors")}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", tail):
        counts["errors" if word.startswith("error") else word] += int(number)
    return counts


def check_torch(venv, base, out):
    """Run the check; returns (record, exit status)."""
    py = str(Path(venv) / "bin" / "python")
    if not Path(py).is_file():
        print(f"compat: {py} does not exist; make the venv and install torch into it first",
              file=sys.stderr)  # fmt: skip
        return None, 2
    before = _out([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    inst = subprocess.run(["tools/install.sh", "--venv", str(venv), "--base", base, "--test-deps"],
                          cwd=REPO, check=False)  # fmt: skip
    if inst.returncode != 0:
        print(f"compat: tools/install.sh failed (exit {inst.returncode})", file=sys.stderr)
        return None, 1
    version = _out([py, "-c", "import importlib.metadata as m; print(m.version('megatron-core'))"])
    torch_version = _out([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    if torch_version != before:
        print(f"compat: installing the fork replaced the venv's torch {before} by {torch_version}"
              " (a pip constraint? PIP_CONSTRAINT=/dev/null lifts a configured one); nothing "
              "was recorded", file=sys.stderr)  # fmt: skip
        return None, 1
    verify = subprocess.run([str(Path(venv) / "bin" / "megatron-fork-verify"), "--import"],
                            cwd="/", capture_output=True, text=True, check=False)  # fmt: skip
    files = _out([py, "tools/fork.py", "tests"]).stdout.split()
    env = {**os.environ, "FORK_TEST_BASE": base}
    for name in ("FORK_MEGATRON_LM", "FORK_TEST_DEV_REPO"):
        env.pop(name, None)
    tests = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    sys.stdout.write(tests.stdout[-3000:])
    record = {
        "base": base,
        "fork_version": version.stdout.strip(),
        "torch": torch_version.split("+")[0],
        "torch_build": torch_version,
        "python": _out(
            [py, "-c", "import platform; print(platform.python_version())"]
        ).stdout.strip(),
        "verify": "ok" if verify.returncode == 0 else f"exit {verify.returncode}",
        "test_files": len(files),
        **_counts(tests.stdout),
        "pytest_exit": tests.returncode,
        "commit": _out(["git", "rev-parse", "--short=10", "HEAD"]).stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "command": f"tools/compat.py torch --venv VENV --base {base}",
    }
    out = Path(out) if out else REPO / "tests/evidence/data/compat" / (
        f"torch-{base}-{record['torch']}.json")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"compat: wrote {out}")
    ok = record["verify"] == "ok" and tests.returncode == 0
    return record, 0 if ok else 1


def main(argv=None):
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("torch", help="the fork of one base under the torch of a venv")
    t.add_argument("--venv", required=True)
    t.add_argument("--base", default=None)
    t.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    base = args.base or _out([sys.executable, "tools/fork.py", "base", "--default"]).stdout.strip()
    _, status = check_torch(Path(args.venv).resolve(), base, args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
