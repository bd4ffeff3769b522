"""pytest plugin: run upstream-layout unit tests on CPU ranks (gloo) inside a Megatron-LM tree.

Upstream's ``tests/unit_tests/test_utilities.py`` ``Utils`` initializes NCCL on one GPU per rank
(``torch.cuda.set_device`` + ``backend='nccl'``), so its tests cannot run on a machine without
GPUs. This plugin is the fork's test tooling, never part of a patch: it installs the fork's CPU
redirect (``tests/harness/cpu_redirect.py`` of this repository, the one the fork's own CPU tests
use) and replaces ``Utils.initialize_distributed`` / ``Utils.destroy_model_parallel`` with gloo
equivalents. Everything else (the tests, ``Utils.initialize_model_parallel``, megatron) is the
tree's own code.

Use, from the root of a Megatron-LM tree (rank and world size as torchrun sets them):

    FORK_CPU_REDIRECT=/path/to/fork/tests/harness/cpu_redirect.py \
    PYTHONPATH=/path/to/fork/tests/harness \
    python -m pytest -p cpu_gloo_plugin tests/unit_tests/...

    torchrun --nproc_per_node 2 -m pytest -p cpu_gloo_plugin tests/unit_tests/...
"""

import datetime
import importlib.util
import os
import sys

import torch


def _load_redirect():
    path = os.environ.get('FORK_CPU_REDIRECT') or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        '..',
        '..',
        'tests',
        'harness',
        'cpu_redirect.py',
    )
    spec = importlib.util.spec_from_file_location('fork_cpu_redirect', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    """Install the CPU redirect and point Utils at a gloo process group."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    redirect = _load_redirect()
    redirect.install()
    # Device RNG state (tensor_parallel/random.py's RNG helpers, which 0003's warmup snapshot
    # uses) is kept on a CPU generator, as in the fork's own pretrain() tests.
    names = ('random', 'get_rng_state', 'set_rng_state', 'manual_seed', 'manual_seed_all')
    redirect._ACTIVE.update({name: redirect.PRETRAIN_COVERED[name] for name in names})
    redirect.patch_tracker_state_setter()

    import megatron.core.parallel_state as ps
    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed():
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            address = os.getenv('MASTER_ADDR', 'localhost')
            port = os.getenv('MASTER_PORT', '29500')
            torch.distributed.init_process_group(
                backend='gloo',
                init_method=f'tcp://{address}:{port}',
                world_size=Utils.world_size,
                rank=Utils.rank,
                timeout=datetime.timedelta(minutes=3),
            )
            torch.distributed.barrier()
        Utils.inited = True

    def destroy_model_parallel():
        if not Utils.inited:
            return
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        Utils.inited = False

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    Utils.destroy_model_parallel = staticmethod(destroy_model_parallel)
    config._fork_cpu_gloo = True


def pytest_report_header(config):
    """Say in the header that this is the CPU (gloo) run, not upstream's GPU setup."""
    return 'fork cpu_gloo_plugin: CPU ranks, gloo, fork cpu_redirect (not upstream NCCL)'
