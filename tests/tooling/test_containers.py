"""The Dockerfile's two targets, built for real by podman on a local stand-in base.

Optional tier "containers": it runs where podman and debootstrap are installed and the suite runs
as root (apt-get install podman debootstrap), and skips otherwise. The stand-in base
(tools/maint/standin_base.sh: Debian bookworm, CPython 3.12, torch 2.13.0 from PyPI) is made once
and kept in podman's storage; each target is then built from scratch (no layer cache) with the
offline kit in .whl/ (the pinned upstream wheel, pyyaml, einops), so no RUN step needs the network.
The rocm target is built with ROCM_TE=skip: the stand-in has no ROCm and GitHub is not reached.
Each image carries upstream's LICENSE and the fork's NOTICE in /usr/share/doc/megatron-core-fork/,
read back from the built image (podman create and podman cp; nothing runs in it).
docs/containers.md says what this proves and what only the real base images can.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.harness import tiers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = '.whl'  # the Dockerfile's default UPSTREAM_WHEEL_DIR, gitignored
TAG = 'localhost/megatron-fork-test'


def _missing():
    if shutil.which('podman') is None:
        return 'podman absent (apt-get install podman debootstrap)'
    if shutil.which('debootstrap') is None:
        return 'debootstrap absent (apt-get install debootstrap)'
    if os.geteuid() != 0:
        return 'needs root (debootstrap and podman storage)'
    return None


pytestmark = tiers.skipif(_missing() is not None, 'containers', _missing() or '')


def run(cmd, **kw):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kw)


@pytest.fixture(scope='module')
def standin():
    """The stand-in base image's tag (made by tools/maint/standin_base.sh unless it exists)."""
    res = run(['bash', 'tools/maint/standin_base.sh', '--python', sys.executable], timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.fixture(scope='module')
def kit():
    """The offline kit in .whl/: the hash-pinned upstream wheel, pyyaml and einops (cp312)."""
    res = run([sys.executable, 'tools/fork.py', 'fetch', '--wheel-dir', KIT], timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    res = run(
        [sys.executable, '-m', 'pip', 'download', '-q', '--disable-pip-version-check']
        + ['--no-deps', '--only-binary', ':all:', '-d', KIT, 'pyyaml', 'einops~=0.8'],
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return KIT


def last_run_output(log):
    """(the last RUN step's instruction, its output lines) from a podman build log."""
    steps = [m for m in re.finditer(r'^(?:\[\d+/\d+\] )?STEP \d+/\d+: (.*)$', log, re.M)]
    assert steps, log[-3000:]
    runs = [m for m in steps if m.group(1).startswith('RUN ')]
    assert runs, 'no RUN step in the build log'
    last = runs[-1]
    assert last is steps[-1], f'the last step is not a RUN: {steps[-1].group(1)}'
    body = re.split(r'\n(?:\[\d+/\d+\] )?COMMIT\b', log[last.end() :], maxsplit=1)[0]
    return last.group(1), [line for line in body.splitlines() if line.strip()]


def _image_file(image, path):
    """The bytes of ``path`` in ``image``: a container is created (not started) and copied from."""
    name = f'licence-check-{os.getpid()}'
    res = run(['podman', 'create', '--name', name, image], timeout=300)
    assert res.returncode == 0, res.stderr
    try:
        with tempfile.TemporaryDirectory() as tmp:
            res = run(['podman', 'cp', f'{name}:{path}', tmp], timeout=300)
            assert res.returncode == 0, res.stderr
            return (pathlib.Path(tmp) / os.path.basename(path)).read_bytes()
    finally:
        run(['podman', 'rm', '-f', name], timeout=300)


@pytest.mark.parametrize('target', ['cuda', 'rocm'])
def test_target_builds_on_standin_and_verifies(target, standin, kit):
    image = f'{TAG}:{target}'
    cmd = ['podman', 'build', '--isolation=chroot', '--pull=never', '--layers=false']
    cmd += ['--target', target, '-t', image]
    for arg in (f'CUDA_BASE_IMAGE={standin}', f'ROCM_BASE_IMAGE={standin}', 'OFFLINE=1'):
        cmd += ['--build-arg', arg]
    if target == 'rocm':
        cmd += ['--build-arg', 'ROCM_TE=skip']
    try:
        res = run(cmd + ['.'], timeout=1800)
        log = res.stdout + res.stderr
        assert res.returncode == 0, log[-5000:]
        step, out = last_run_output(log)
        assert 'tools/install.sh --python python3 --no-venv --no-torch' in step, step
        # install.sh's last step: `megatron_fork.manifest --import`, run from /.
        assert 'import megatron.core, megatron.training: ok' in out, '\n'.join(out[-30:])
        assert out[-1].strip() == 'verify: OK', '\n'.join(out[-30:])
        if target == 'rocm':
            assert 'ROCM_TE=skip: no Transformer Engine installed' in log
        # The licence files where the Dockerfile puts them, read from the image (no podman run).
        for name in ('LICENSE', 'NOTICE'):
            expected = pathlib.Path(REPO, name).read_bytes()
            assert _image_file(image, f'/usr/share/doc/megatron-core-fork/{name}') == expected, name
    finally:
        run(['podman', 'rmi', '-f', image], timeout=300)
