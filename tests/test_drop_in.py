"""The drop-in starts upstream's entry points: ``compile_helpers()`` in an installed layout.

``initialize_megatron()`` calls ``megatron.core.datasets.utils.compile_helpers()``, which runs
``make`` in the package's ``datasets`` folder. An installed wheel has the compiled ``helpers_cpp``
there but no Makefile. Each arm copies a tree into the installed layout (no Makefile, the compiled
helper taken from the fork installed in this environment) and calls the real function.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launcher import resolve_tree

FORK = 'fork'
PRISTINE = 'pristine-0.18.2'
NO_MAKEFILE = 'No targets specified and no makefile found'
CALL = (
    'from megatron.core.datasets.utils import compile_helpers\n'
    'compile_helpers()\n'
    'print("compile_helpers returned")\n'
)


def _compiled_helper():
    """Path of helpers_cpp*.so of the fork installed in this environment (tools/install.sh)."""
    proc = subprocess.run(
        [sys.executable, '-I', '-c', 'import megatron.core.datasets.helpers_cpp as h; print(h.__file__)'],
        cwd='/',
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f'the fork is not installed here (run tools/install.sh):\n{proc.stderr}'
    return Path(proc.stdout.strip())


def _installed_layout(tmp_path, tree, helper=True, makefile=None):
    """Copy ``tree``'s megatron/ package to tmp_path as pip installs it; return the copy's root."""
    _, src = resolve_tree(tree)
    root = tmp_path / tree
    shutil.copytree(
        Path(src) / 'megatron', root / 'megatron', ignore=shutil.ignore_patterns('__pycache__')
    )
    datasets = root / 'megatron' / 'core' / 'datasets'
    assert not (datasets / 'Makefile').exists()
    if helper:
        shutil.copy2(_compiled_helper(), datasets)
    if makefile is not None:
        (datasets / 'Makefile').write_text(makefile)
    return root


def _call(root):
    return subprocess.run(
        [sys.executable, '-c', CALL],
        cwd=root,
        env={'PYTHONPATH': str(root), 'PATH': '/usr/bin:/bin', 'NO_VCS_VERSION': '1'},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_pristine_exits_without_makefile(tmp_path):
    proc = _call(_installed_layout(tmp_path, PRISTINE))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert NO_MAKEFILE in proc.stderr
    assert 'compile_helpers returned' not in proc.stdout


def test_fork_returns_when_helper_is_installed(tmp_path):
    proc = _call(_installed_layout(tmp_path, FORK))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'compile_helpers returned' in proc.stdout
    assert NO_MAKEFILE not in proc.stderr


def test_fork_still_fails_without_helper_or_makefile(tmp_path):
    proc = _call(_installed_layout(tmp_path, FORK, helper=False))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert NO_MAKEFILE in proc.stderr


@pytest.mark.parametrize('helper', [True, False])
def test_fork_runs_make_when_makefile_exists(tmp_path, helper):
    # A source checkout keeps rebuilding an edited helpers.cpp: make runs whatever is installed.
    makefile = 'default:\n\t@echo make-ran-here\n'
    proc = _call(_installed_layout(tmp_path, FORK, helper=helper, makefile=makefile))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'make-ran-here' in proc.stdout


def test_installed_fork_has_helper_and_no_makefile():
    helper = _compiled_helper()
    assert helper.is_file()
    assert not (helper.parent / 'Makefile').exists()
