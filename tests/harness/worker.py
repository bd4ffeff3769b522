"""One rank of a harness world. Launched by tests/harness/launcher.py; not imported by tests.

Usage: python -m tests.harness.worker SPEC_JSON RANK
The spec holds world_size, backend, tree_path, tree_label, master_port, out_dir, pg_timeout_s and
calls ([["pkg.module:function", {kwargs}], ...]). Results go to <out_dir>/rank<RANK>.json after
every
call, so a crash still leaves the results of the calls before it.
"""

import datetime
import faulthandler
import importlib
import json
import multiprocessing
import os
import sys
import time
import traceback
import types

SHADOW_EXIT = 17


def _write(path, payload):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _log(msg):
    sys.stderr.write(f'{time.strftime("%H:%M:%S")} {msg}\n')
    sys.stderr.flush()


def _reset_globals():
    """Destroy model-parallel state and other megatron globals between calls."""
    from megatron.core import parallel_state
    from tests.harness import group_cache

    parallel_state.destroy_model_parallel()
    group_cache.STATE.reset()
    try:
        from megatron.core import num_microbatches_calculator as nmc

        nmc.destroy_num_microbatches_calculator()
    except (ImportError, AttributeError):
        pass
    try:
        from megatron.core.tensor_parallel import random as tp_random

        tp_random.get_cuda_rng_tracker().reset()
    except (ImportError, AttributeError):
        pass
    try:
        from megatron.core import rerun_state_machine

        rerun_state_machine.destroy_rerun_state_machine()
    except (ImportError, AttributeError):
        pass
    try:  # process-wide MoE metric entries (every base), sized by the first model's layers
        from megatron.core.transformer.moe import moe_logging

        for name in ('destroy_moe_metrics_tracker', 'destroy_moe_overload_factor_tracker'):
            getattr(moe_logging, name, lambda: None)()
    except ImportError:
        pass
    gv = sys.modules.get('megatron.training.global_vars')
    if gv is not None and hasattr(gv, 'destroy_global_vars'):
        gv.destroy_global_vars()


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return json.loads(json.dumps(value, default=repr))


def _device(backend, rank):
    """Install the CPU redirect (gloo) or pick this rank's GPU; return the torch device."""
    import torch

    if backend == 'gloo':
        from tests.harness import cpu_redirect

        cpu_redirect.install()
        return torch.device('cpu')
    torch.cuda.set_device(rank)
    return torch.device('cuda', rank)


def _refuse_shadowed_core(tree):
    """Exit with SHADOW_EXIT when megatron.core was not imported from the tree under test."""
    import megatron.core

    core_file = os.path.realpath(megatron.core.__file__)
    if not core_file.startswith(tree + os.sep):
        sys.stderr.write(
            f"HARNESS-SHADOWED: megatron.core was imported from {core_file}, "
            "which is not under the "
            f"tree under test {tree}; refusing to run (an installed or other megatron shadows it)\n"
        )
        sys.exit(SHADOW_EXIT)


def _init_world(spec, rank, world_size, backend, device, tree):
    """Join the process group; return the context every scenario receives."""
    import torch.distributed as dist

    _log(f'[rank {rank}] imports done')

    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{spec['master_port']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=spec['pg_timeout_s']),
    )
    ctx = types.SimpleNamespace(
        rank=rank,
        world_size=world_size,
        device=device,
        backend=backend,
        tree=spec['tree_label'],
        tree_path=tree,
    )
    _log(f'[rank {rank}] process group ready')
    if os.environ.get('FORK_TEST_REUSE_GROUPS', '1') != '0':
        from megatron.core import parallel_state
        from tests.harness import group_cache

        group_cache.install(dist, parallel_state)
    return ctx


def _run_call(ctx, target, kwargs, results):
    """Run one scenario call, appending its result (or its error) to ``results``."""
    try:
        module_name, func_name = target.split(':')
        func = getattr(importlib.import_module(module_name), func_name)
        out = func(ctx, **kwargs)
        results.append(_jsonable(out if out is not None else {}))
    except Exception as exc:  # noqa: BLE001 - reported per rank
        sys.stderr.write(f'[rank {ctx.rank}] {target} raised:\n{traceback.format_exc()}\n')
        results.append({'error': f'{type(exc).__name__}: {exc}'})


def _run_calls(ctx, calls, out_path):
    """Run every call in order, writing the results after each; return why the world broke."""
    import torch
    import torch.distributed as dist

    rank = ctx.rank
    results = []
    broken = None
    for target, kwargs in calls:
        if broken is not None:
            results.append({'error': f'HarnessError: world broken by an earlier call ({broken})'})
            _write(out_path, results)
            continue
        torch.manual_seed(1234)
        t0 = time.monotonic()
        _run_call(ctx, target, kwargs, results)
        try:
            _reset_globals()
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(f'[rank {rank}] reset after {target} failed: {exc!r}\n')
        try:
            dist.barrier()
        except Exception as exc:  # noqa: BLE001
            broken = f'barrier after {target} failed: {type(exc).__name__}: {exc}'
        _write(out_path, results)
        _log(f'[rank {rank}] {target} done in {time.monotonic() - t0:.2f}s')
    return broken


def main(spec_path, rank):
    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(rank)
    # A fatal signal (an abort in a collective's thread, a segfault) prints every thread's Python
    # stack into the rank log, which the launcher hands to the pytest summary.
    faulthandler.enable(all_threads=True)
    world_size = spec['world_size']
    backend = spec['backend']
    tree = os.path.realpath(spec['tree_path'])
    out_path = os.path.join(spec['out_dir'], f'rank{rank}.json')

    sys.path.insert(0, tree)
    device = _device(backend, rank)
    _refuse_shadowed_core(tree)
    ctx = _init_world(spec, rank, world_size, backend, device, tree)
    broken = _run_calls(ctx, spec['calls'], out_path)
    _log(f'[rank {rank}] all calls done')
    # os._exit skips multiprocessing's finalizers: a child the tree under test started (the
    # Manager behind dist_checkpointing's async results queue) would outlive the world, holding
    # its memory until the test job ends.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if broken is None else 3)


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
