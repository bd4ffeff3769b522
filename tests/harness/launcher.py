"""Launch a world of N ranks once and run a list of scenario calls in it.

Public API: :func:`run_world`, :func:`resolve_tree`, :func:`backend`, :class:`HarnessError`,
:class:`TreeShadowedError`. See tests/harness/README.md.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHADOW_EXIT = 17
# One entry per rank that exited non-zero with calls unfinished: what it was running, its log tail.
DEATHS = []


class HarnessError(RuntimeError):
    """The world could not be launched or did not finish (timeout, crash, missing results)."""


class TreeShadowedError(HarnessError):
    """megatron.core was imported from somewhere other than the tree under test."""


def backend():
    """The collective backend selected by FORK_TEST_BACKEND (default gloo, CPU ranks)."""
    value = os.environ.get('FORK_TEST_BACKEND', 'gloo').strip().lower()
    if value not in ('gloo', 'nccl'):
        raise HarnessError(f"FORK_TEST_BACKEND must be 'gloo' or 'nccl', not {value!r}")
    return value


def gpu_count():
    """Number of visible GPUs (0 when torch is missing or no GPU)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def resolve_tree(tree):
    """Map a tree label or an absolute path to a directory.

    Labels: 'fork' (the fork on the base selected by FORK_TEST_BASE, see tests/harness/bases.py),
    'fork-<base>' (the fork on that base), 'pristine-<base>' (upstream without patches) and
    'pristine' (the selected base's). Missing or stale trees are built with tools/fork.py.

    Args:
        tree: a label above or an absolute directory containing megatron/.

    Returns:
        (label, absolute path of the directory that contains megatron/).
    """
    from tests.harness import bases  # pylint: disable=import-outside-toplevel

    if os.path.isabs(tree):
        path, label = tree, tree
    elif tree == 'fork' or tree.startswith('fork-'):
        base = bases.BASE if tree == 'fork' else tree[len('fork-') :]
        label, path = tree, _fork_tree(bases, base)
    elif tree == 'pristine' or tree.startswith('pristine-'):
        base = bases.BASE if tree == 'pristine' else tree[len('pristine-') :]
        label = f'pristine-{base}'
        path = os.path.join(REPO, 'build', 'trees', label)
        if not os.path.isdir(os.path.join(path, 'megatron')):
            extra = bases.source_args(base) if base in bases.PIN['bases'] else []
            _fork_tool('pristine', base, *extra)
    else:
        raise HarnessError(
            f"unknown tree {tree!r}: use 'fork', 'fork-<base>', 'pristine-<base>' or an "
            'absolute path'
        )
    if not os.path.isdir(os.path.join(path, 'megatron')):
        raise HarnessError(f'tree {tree!r}: {path} does not contain megatron/')
    return label, path


def _fork_tree(bases, base):
    """The repo root when megatron/ is built from ``base``, else build/trees/fork-<base>."""
    # tests.harness.bases put the repository's tools/ first on sys.path.
    from megatron_fork import series  # pylint: disable=import-outside-toplevel

    if base == bases.WORKSPACE.base():
        return REPO
    if not os.path.isdir(os.path.join(REPO, 'megatron')) and base == bases.PIN['default']:
        _fork_tool('materialize', '--base', base, *bases.source_args(base))
        return REPO
    path = os.path.join(REPO, 'build', 'trees', f'fork-{base}')
    stamp = os.path.join(path, '.series-sha256')
    digest = series.series_digest(series.load_series(bases.WORKSPACE.patch_dir(base)))
    current = open(stamp).read().strip() if os.path.isfile(stamp) else None
    if current != digest or not os.path.isdir(os.path.join(path, 'megatron')):
        _fork_tool('materialize', '--base', base, '--dest', path, *bases.source_args(base))
        with open(stamp, 'w') as f:
            f.write(digest + '\n')
    return path


def _fork_tool(*args):
    tool = os.path.join(REPO, 'tools', 'fork.py')
    if not os.path.exists(tool):
        raise HarnessError(f'{tool} does not exist; cannot run fork.py {" ".join(args)}')
    proc = subprocess.run(
        [sys.executable, tool, *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise HarnessError(
            f'fork.py {" ".join(args)} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}'
        )


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def default_timeout(n_calls):
    """Wall-clock budget for a world: startup plus a generous per-call allowance."""
    return float(os.environ.get('FORK_TEST_WORLD_TIMEOUT', 0)) or 180.0 + 60.0 * n_calls


_START_ATTEMPTS = 3


def run_world(world_size, tree, calls, timeout=None, extra_env=None, pg_timeout_s=None):
    """Launch ``world_size`` ranks once and run every call in order (see :func:`_run_world_once`).

    The master port is picked free and released before rank 0 binds it, so another process can
    take it in between; a world that failed to start on ``EADDRINUSE`` is launched again on a new
    port (up to 3 attempts). Any other failure is raised at once.

    A rank killed by a signal it did not get from the launcher (an abort, a segfault: never a
    Python exception, which is a result) takes every later call of its world with it. The calls
    from the first one it left unfinished run once more in a fresh world; the death stays in
    :data:`DEATHS` for the session summary either way, and a second death is reported as is.
    """
    results, crashed_at = _start(world_size, tree, calls, timeout, extra_env, pg_timeout_s)
    if crashed_at is None:
        return results
    DEATHS.append(
        f'{resolve_tree(tree)[0]} world {world_size}: calls {crashed_at}-{len(calls) - 1} run '
        'again in a fresh world after the death above'
    )
    again, _ = _start(world_size, tree, calls[crashed_at:], timeout, extra_env, pg_timeout_s)
    return results[:crashed_at] + again


def _start(world_size, tree, calls, timeout, extra_env, pg_timeout_s):
    for attempt in range(_START_ATTEMPTS):
        try:
            return _run_world_once(world_size, tree, calls, timeout, extra_env, pg_timeout_s)
        except TreeShadowedError:
            raise
        except HarnessError as exc:
            text = str(exc)
            port_taken = 'failed to start' in text and (
                'EADDRINUSE' in text or 'address already in use' in text.lower()
            )
            if not port_taken or attempt == _START_ATTEMPTS - 1:
                raise


def _run_world_once(world_size, tree, calls, timeout=None, extra_env=None, pg_timeout_s=None):
    """Launch ``world_size`` ranks once and run every call in order.

    Args:
        world_size: number of ranks (processes).
        tree: 'fork', 'pristine-<ver>' or an absolute directory containing megatron/.
        calls: list of ("package.module:function", kwargs) with JSON-able kwargs.
        timeout: wall-clock seconds for the whole world (default: default_timeout(len(calls))).
        extra_env: environment overrides for the ranks (tests of the harness itself).
        pg_timeout_s: process-group timeout; a collective that waits longer raises.

    Returns:
        (results, crashed_at): one list per call, each holding the per-rank results (dict
        returned by the scenario, or {"error": "<ExcType>: <message>"}); and the first call a
        rank left unfinished when a signal of its own killed it (None if none did).

    Raises:
        TreeShadowedError: megatron.core did not come from the requested tree.
        HarnessError: launch failure, timeout, or a rank died without results.
    """
    be = backend()
    calls = [(target, dict(kwargs or {})) for target, kwargs in calls]
    label, path = resolve_tree(tree)
    if be == 'nccl' and world_size > gpu_count():
        raise HarnessError(
            f'world_size {world_size} needs {world_size} GPUs, {gpu_count()} visible'
        )
    timeout = timeout or default_timeout(len(calls))
    work = tempfile.mkdtemp(prefix=f'harness-w{world_size}-')
    spec_path = _write_spec(world_size, be, path, label, work, pg_timeout_s, calls)
    env = _rank_env(be, world_size, extra_env)
    procs, logs = _spawn_ranks(world_size, spec_path, work, env)
    killed = _wait_ranks(procs, logs, world_size, label, timeout, work)
    if any(p.returncode == SHADOW_EXIT for p in procs):
        raise TreeShadowedError(_tails(work, world_size))
    per_rank, crashed = _collect(procs, killed, world_size, label, calls, work)
    # The first call some rank (the dead one, or a peer killed while waiting) left unfinished.
    crashed_at = min(done for done, _ in per_rank) if crashed else None
    per_rank = [res for _, res in per_rank]
    if all(procs[r].returncode != 0 for r in range(world_size)) and not any(
        os.path.exists(os.path.join(work, f'rank{r}.json')) for r in range(world_size)
    ):
        raise HarnessError(
            f'world of {world_size} on {label} ({path}) failed to start, return codes '
            f'{[p.returncode for p in procs]}\n' + _tails(work, world_size)
        )
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(calls))], crashed_at


def _write_spec(world_size, be, path, label, work, pg_timeout_s, calls):
    """Write the world's spec.json (read by every rank's worker); return its path."""
    spec = {
        'world_size': world_size,
        'backend': be,
        'tree_path': path,
        'tree_label': label,
        'master_port': _free_port(),
        'out_dir': work,
        'pg_timeout_s': pg_timeout_s or float(os.environ.get('FORK_TEST_PG_TIMEOUT', 300)),
        'calls': calls,
    }
    spec_path = os.path.join(work, 'spec.json')
    with open(spec_path, 'w') as f:
        json.dump(spec, f)
    return spec_path


def _rank_env(be, world_size, extra_env):
    """The ranks' environment: this one, CPU-only threads split for gloo, then the overrides."""
    env = dict(os.environ)
    if be == 'gloo':
        threads = str(max(1, (os.cpu_count() or 1) // world_size))
        env.setdefault('OMP_NUM_THREADS', threads)
        env['CUDA_VISIBLE_DEVICES'] = ''
    env.setdefault('PYTHONWARNINGS', 'ignore')
    env.update(extra_env or {})
    return env


def _spawn_ranks(world_size, spec_path, work, env):
    """Start one worker process per rank, each logging to rank<r>.log; return (procs, logs)."""
    procs, logs = [], []
    for rank in range(world_size):
        log = open(os.path.join(work, f'rank{rank}.log'), 'w')
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, '-m', 'tests.harness.worker', spec_path, str(rank)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs, logs


def _wait_ranks(procs, logs, world_size, label, timeout, work):
    """Wait for the ranks (10 s more once one failed), kill the rest; return the killed ranks."""
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise HarnessError(
                    f'world of {world_size} on {label} timed out after {timeout:.0f}s\n'
                    + _tails(work, world_size)
                )
            if any(p.returncode not in (None, 0) for p in procs):
                failed_at = failed_at or now
                if now - failed_at > 10:  # peers of a dead rank would block in collectives
                    break
            time.sleep(0.05)
    finally:
        killed = set()
        for rank, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
                killed.add(rank)
        for log in logs:
            log.close()
    return killed


def _collect(procs, killed, world_size, label, calls, work):
    """Read each rank's results, an error for every call it left unfinished.

    Returns ([(calls done, results)] per rank, whether a rank died of a signal of its own).
    """
    per_rank = []
    crashed = False
    for rank in range(world_size):
        out = os.path.join(work, f'rank{rank}.json')
        res = json.load(open(out)) if os.path.exists(out) else []
        done = len(res)
        crashed |= procs[rank].returncode < 0 and rank not in killed and done < len(calls)
        for i in range(done, len(calls)):
            error = (
                f'HarnessError: rank {rank} exited (rc {procs[rank].returncode}) '
                f'before call {i} ({calls[i][0]}) finished; logs in {work}'
            )
            if i == done and procs[rank].returncode != 0 and rank not in killed:
                # The logs stay behind on the machine that ran the world: keep the tail for the
                # session's summary (tests/conftest.py), which is all a CI report shows.
                DEATHS.append(
                    f'{label} world {world_size}: {error}\n' + _tails(work, 1, n=6000, ranks=[rank])
                )
            res.append({'error': error})
        per_rank.append((done, res))
    return per_rank, crashed


def _tails(work, world_size, n=3000, ranks=None):
    parts = []
    for rank in range(world_size) if ranks is None else ranks:
        try:
            text = open(os.path.join(work, f'rank{rank}.log')).read()
        except OSError:
            text = ''
        parts.append(f'--- rank {rank} log tail ---\n{text[-n:]}')
    return '\n'.join(parts)
