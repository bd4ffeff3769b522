"""The drop-in starts upstream's entry points: ``compile_helpers()`` in an installed layout.

``initialize_megatron()`` calls ``megatron.core.datasets.utils.compile_helpers()``, which runs
``make`` in the package's ``datasets`` folder. An installed wheel has the compiled ``helpers_cpp``
there but no Makefile. Each arm copies a tree into the installed layout (no Makefile, the compiled
helper taken from the fork installed in this environment) and calls the real function.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launcher import resolve_tree

# Installs, files and exit codes: no rounding can change its outcome (pytest.ini, rounding_free).
pytestmark = pytest.mark.rounding_free

REPO = Path(__file__).resolve().parents[1]
FORK = 'fork'
PRISTINE = 'pristine'
NO_MAKEFILE = 'No targets specified and no makefile found'
CALL = (
    'from megatron.core.datasets.utils import compile_helpers\n'
    'compile_helpers()\n'
    'print("compile_helpers returned")\n'
)


def _compiled_helper():
    """Path of helpers_cpp*.so of the fork installed in this environment (tools/install.sh)."""
    proc = subprocess.run(
        [
            sys.executable,
            '-I',
            '-c',
            'import megatron.core.datasets.helpers_cpp as h; print(h.__file__)',
        ],
        cwd='/',
        capture_output=True,
        text=True,
    )
    assert (
        proc.returncode == 0
    ), f'the fork is not installed here (run tools/install.sh):\n{proc.stderr}'
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


def _installed(code):
    """Run ``code`` in this environment's installed fork, from inside this git repository."""
    proc = subprocess.run(
        [sys.executable, '-I', '-c', code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_version_is_the_distributions_inside_a_git_repo():
    # Upstream appends `git rev-parse --short HEAD` of whatever repository surrounds the package;
    # the drop-in reports its own version, also when imported from inside a clone.
    out = _installed(
        'import importlib.metadata as md, megatron.core as m;'
        'print(m.__version__, md.version("megatron-core"), sep="\\n")'
    )
    version, dist_version = out.splitlines()[-2:]
    assert version == dist_version
    assert '+fork.' in version


def _requirements(lines):
    return sorted(
        line.split(':', 1)[1].strip() for line in lines if line.startswith('Requires-Dist:')
    )


def test_requirements_and_extras_match_upstream():
    out = _installed(
        'import importlib.metadata as md, json, megatron_fork.manifest as mf;'
        'meta = md.metadata("megatron-core");'
        'print(json.dumps([meta.get_all("Provides-Extra"), meta.get_all("Requires-Dist"),'
        ' json.loads(mf.installed_manifest().read_text())["base"]]))'
    )
    extras, requires, base = json.loads(out.splitlines()[-1])
    from megatron_fork import dist, upstream

    from tests.harness.bases import PIN as pin  # conftest: bases put the repo's tools/ on sys.path

    wheel = upstream.fetch_wheel(pin, base["name"], offline=True)
    text = dist.wheel_metadata(wheel)
    upstream_extras = [
        ln.split(':', 1)[1].strip() for ln in text.splitlines() if ln.startswith('Provides-Extra:')
    ]
    assert extras == upstream_extras
    assert {'training', 'mlm', 'dev', 'lts', 'te', 'ssm'} <= set(extras)
    assert sorted(requires) == _requirements(text.splitlines())
