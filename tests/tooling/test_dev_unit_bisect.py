"""tools/maint/dev_unit_bisect.sh: each patch's unit test against the series without the patch.

A stand-in for a Megatron-LM tree after `git am` of a series: a base commit (with the part of
upstream's test utilities that the CPU plugin reads), then one commit per patch, each adding its
test under tests/unit_tests/. The script must call a test that fails without its patch
FAILS-WITHOUT, one that passes without it PASSES-WITHOUT (exit 1), and leave the checkout at its
HEAD.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "maint" / "dev_unit_bisect.sh"


def _git(work, *args):
    cmd = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def _commit(work, message, files):
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", message)
    return _git(work, "rev-parse", "HEAD")


def _series(tmp_path, second_test):
    work = tmp_path / "mlm"
    work.mkdir()
    _git(work, "init", "-q")
    # upstream's test utilities as far as tests/harness/cpu_gloo_plugin.py reads them
    utils = "class Utils:\n    rank = -1\n    world_size = 1\n    inited = False\n"
    utils += "\n    @staticmethod\n    def destroy_model_parallel():\n        pass\n"
    base = _commit(
        work,
        "base",
        {
            "lib/value.py": "VALUE = 1\n",
            "tests/__init__.py": "",
            "tests/unit_tests/__init__.py": "",
            "tests/unit_tests/test_utilities.py": utils,
        },
    )
    test = "import sys\nsys.path.insert(0, 'lib')\nimport value\n\n\ndef test_value():\n"
    _commit(
        work,
        "lib: the value is 2",
        {
            "lib/value.py": "VALUE = 2\n",
            "tests/unit_tests/test_value.py": test + "    assert value.VALUE == 2\n",
        },
    )
    _commit(
        work,
        "lib: a patch whose test cannot fail",
        {"lib/other.py": "OTHER = 3\n", "tests/unit_tests/test_other.py": second_test},
    )
    return work, base


def _run(work, base):
    env = {**os.environ, "DEV_BASE": base}
    return subprocess.run(
        ["bash", str(SCRIPT), str(work), sys.executable],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def test_a_test_that_passes_without_its_patch_is_named_and_fails_the_run(tmp_path):
    """The first patch's test fails without it; the second's passes without it."""
    work, base = _series(tmp_path, "def test_other():\n    assert True\n")
    head = _git(work, "rev-parse", "HEAD")
    proc = _run(work, base)
    lines = [ln.split()[0] for ln in proc.stdout.splitlines() if not ln.startswith(" ")]
    assert lines == ["FAILS-WITHOUT", "PASSES-WITHOUT"], proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert _git(work, "rev-parse", "HEAD") == head and not _git(work, "status", "--porcelain")
