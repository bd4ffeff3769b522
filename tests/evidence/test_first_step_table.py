"""The committed H200 first-step tables are what tools/maint/first_step_table.py makes of the
committed logs, and the tool refuses a directory without logs."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / 'tools' / 'maint' / 'first_step_table.py'
RESULTS = ROOT / 'tests' / 'evidence' / 'data' / 'first-step-h200'


def table(*dirs):
    """The tool's stdout for the given result directories."""
    run = subprocess.run(
        [sys.executable, str(TOOL), *map(str, dirs)], capture_output=True, text=True, check=True
    )
    return run.stdout


@pytest.mark.parametrize(
    'dirs, expected',
    [(['run5'], 'run5/table.md'), (['run3', 'run4-final', 'run5'], 'pooled-run3-run4-run5.md')],
)
def test_committed_table_matches_the_logs(dirs, expected):
    assert table(*(RESULTS / d for d in dirs)) == (RESULTS / expected).read_text()


def test_pooled_table_keeps_every_run_and_the_medians():
    lines = table(RESULTS / 'run3', RESULTS / 'run4-final', RESULTS / 'run5').splitlines()
    rows = [line for line in lines if line.startswith('| large |') or line.startswith('| small |')]
    assert sum('| warmup2 |' in row for row in rows) == 39
    assert all(row.endswith('| yes |') for row in rows)  # losses equal to the none arm
    summary = [line for line in lines if line.startswith('- large warmup2:')]
    assert summary == [
        '- large warmup2: 1st/steady median 0.99, range 0.90-1.18, <= 1.05 in 12 of 16, mean rank '
        '0.48; 2nd/steady median 0.99, range 0.93-1.17, <= 1.05 in 13 of 16, mean rank 0.50'
    ]


def test_directory_without_logs_is_an_error(tmp_path):
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 1
    assert f'no *.log or *.log.gz files in {tmp_path}' in run.stderr
