"""tools/install.sh picks its interpreter the same way every time.

The old check (`pyenv versions --bare | grep -qx 3.12.1` under `pipefail`) failed when grep quit
before pyenv had written all of its output, about one run in twenty, and the install then went on
with a different interpreter or died with exit 127.
"""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = 200


def test_interpreter_choice_is_stable_over_200_runs():
    script = f'for i in $(seq {RUNS}); do tools/install.sh --print-python || echo "rc=$?"; done'
    proc = subprocess.run(
        ["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == RUNS, proc.stderr[-1000:]
    assert len(set(lines)) == 1, sorted(set(lines))
    version = subprocess.run(
        [lines[0], "-c", "import sys; print(sys.version_info[:2] >= (3, 12))"],
        capture_output=True,
        text=True,
    )
    assert version.stdout.strip() == "True", (lines[0], version.stdout, version.stderr)
