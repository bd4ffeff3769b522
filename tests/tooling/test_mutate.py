"""The mutation runner (tools/maint/mutate.py) on a throw-away tree: no worlds, a few seconds.

Each case builds a tiny "materialized tree" and a mutation spec in tmp_path, with a pytest file
that checks the tree's source text, and runs the real runner as a subprocess.
"""

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MUTATE = REPO / 'tools' / 'maint' / 'mutate.py'
SOURCE = 'def guard(count, golden):\n    return count > golden\n'


def _spec(mutations, entries):
    """Write entries (dicts) as one [[mutation]] TOML file per patch number."""
    mutations.mkdir(exist_ok=True)
    by_patch = {}
    for entry in entries:
        by_patch.setdefault(entry['id'][:4], []).append(entry)
    for patch, items in by_patch.items():
        lines = []
        for entry in items:
            lines.append('[[mutation]]')
            for key, value in entry.items():
                lines.append(f'{key} = {json.dumps(value)}')
            lines.append('')
        (mutations / f'{patch}.toml').write_text('\n'.join(lines))


@pytest.fixture
def world(tmp_path):
    """A tree with one source file, a test that checks its guard, and a spec folder."""
    tree = tmp_path / 'tree'
    src = tree / 'megatron' / 'guard.py'
    src.parent.mkdir(parents=True)
    src.write_text(SOURCE)
    test = tmp_path / 'check_guard.py'
    test.write_text(
        'import importlib.util\n'
        f'SPEC = importlib.util.spec_from_file_location("guard", {str(src)!r})\n'
        'def test_boundary():\n'
        '    mod = importlib.util.module_from_spec(SPEC)\n'
        '    SPEC.loader.exec_module(mod)\n'
        '    assert mod.guard(2, 1) and not mod.guard(1, 1)\n'
    )
    slow = tmp_path / 'check_slow.py'
    slow.write_text('import time\ndef test_slow():\n    time.sleep(60)\n')
    return {'tmp': tmp_path, 'tree': tree, 'src': src, 'test': str(test), 'slow': str(slow)}


def _run(world, *args, wait=True):
    cmd = [sys.executable, str(MUTATE), '--tree', str(world['tree'])]
    cmd += ['--mutations', str(world['tmp'] / 'mutations'), *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _entry(world, mid, old, new, tests=None):
    return {
        'id': mid,
        'file': 'megatron/guard.py',
        'old': old,
        'new': new,
        'tests': tests or [world['test']],
        'why': 'test',
    }


def test_kills_a_caught_mutation_survives_a_missed_one_and_restores(world):
    before = world['src'].stat()
    _spec(
        world['tmp'] / 'mutations',
        [
            _entry(world, '0002-off-by-one', 'count > golden', 'count > golden + 1'),
            # Same behaviour on integers: the test cannot notice (an equivalent mutant).
            _entry(world, '0002-equivalent', 'count > golden', 'count >= golden + 1'),
        ],
    )
    out = world['tmp'] / 'out.json'
    proc = _run(world, '--json', str(out), '--quiet')
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'KILLED 0002-off-by-one' in proc.stdout
    assert 'SURVIVED 0002-equivalent' in proc.stdout
    assert 'killed/total: 1/2' in proc.stdout
    data = json.loads(out.read_text())
    assert (data['killed'], data['total']) == (1, 2)
    assert data['results'][0]['failed'][0].endswith('check_guard.py::test_boundary')
    assert world['src'].read_text() == SOURCE
    assert world['src'].stat().st_mtime_ns == before.st_mtime_ns
    assert not list(world['tree'].rglob('*.pyc'))


def test_all_killed_exits_0_and_only_and_patch_select(world):
    _spec(
        world['tmp'] / 'mutations',
        [
            _entry(world, '0001-a', 'count > golden', 'count > golden + 1'),
            _entry(world, '0002-b', 'count > golden', 'count >= golden'),
        ],
    )
    proc = _run(world, '--patch', '0002', '--quiet')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'killed/total: 1/1' in proc.stdout and '0001-a' not in proc.stdout
    proc = _run(world, '--only', '0001-a', '--list')
    assert proc.returncode == 0 and proc.stdout.startswith('0001-a\tmegatron/guard.py\t')
    proc = _run(world, '--only', 'nope')
    assert proc.returncode == 2 and 'unknown mutation id: nope' in proc.stderr


@pytest.mark.parametrize('old,count', [('golden', 2), ('absent text', 0)])
def test_refuses_old_text_that_is_not_unique(world, old, count):
    _spec(world['tmp'] / 'mutations', [_entry(world, '0002-bad', old, 'x')])
    proc = _run(world, '--quiet')
    assert proc.returncode == 2
    assert f'0002-bad: old text occurs {count} times in megatron/guard.py' in proc.stderr
    assert world['src'].read_text() == SOURCE


def test_refuses_malformed_specs(world):
    mutations = world['tmp'] / 'mutations'
    entry = _entry(world, '0002-x', 'count > golden', 'count >= golden')
    _spec(mutations, [entry, dict(entry)])
    proc = _run(world)
    assert proc.returncode == 2 and '0002-x: duplicate id' in proc.stderr
    del entry['tests']
    (mutations / '0002.toml').unlink()
    _spec(mutations, [entry])
    proc = _run(world)
    assert proc.returncode == 2 and '0002-x: missing tests' in proc.stderr


def test_pytest_error_is_not_counted_as_killed(world):
    _spec(
        world['tmp'] / 'mutations',
        [_entry(world, '0002-e', 'count > golden', 'count >= golden', [world['test'] + '::nope'])],
    )
    proc = _run(world, '--quiet')
    assert proc.returncode == 1
    assert 'ERROR 0002-e' in proc.stdout and 'killed/total: 0/1' in proc.stdout
    assert world['src'].read_text() == SOURCE


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM])
def test_interrupt_restores_the_file(world, sig):
    _spec(
        world['tmp'] / 'mutations',
        [_entry(world, '0002-s', 'count > golden', 'count >= golden', [world['slow']])],
    )
    proc = _run(world, wait=False)
    deadline = time.monotonic() + 60
    while world['src'].read_text() == SOURCE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert world['src'].read_text() != SOURCE, 'the mutation was never applied'
    time.sleep(1.0)  # let pytest start
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert 'interrupted' in err
    assert world['src'].read_text() == SOURCE


def test_repository_specs_are_well_formed():
    """Every spec of the repository parses, ids are unique and the tests it names exist."""
    ids = set()
    for path in sorted((REPO / 'tools' / 'maint' / 'mutations').glob('*.toml')):
        for entry in tomllib.loads(path.read_text())['mutation']:
            assert entry['id'].startswith(path.stem) and entry['id'] not in ids
            ids.add(entry['id'])
            assert entry['file'].startswith('megatron/') and entry['why']
            for test in entry['tests']:
                assert (REPO / test.split('::')[0]).is_file(), test
    assert ids


def test_refuses_a_tree_the_tests_do_not_import():
    """For the base the repository's megatron/ is materialized from, the harness imports the
    repository itself: mutating build/trees/fork-<base> would let every mutation "survive"."""
    from tests.harness import bases  # pylint: disable=import-outside-toplevel

    base = bases.WORKSPACE.base()
    if base is None:
        pytest.fail('megatron/ is not materialized in this checkout: run tools/install.sh')
    tree = REPO / 'build' / 'trees' / f'fork-{base}'
    proc = subprocess.run(
        [sys.executable, str(MUTATE), '--tree', str(tree), '--list'],
        capture_output=True,
        text=True,
        env={**os.environ, 'FORK_TEST_BASE': base},
    )
    assert proc.returncode == 2
    assert f'the tests of base {base} import' in proc.stderr and '--tree .' in proc.stderr
