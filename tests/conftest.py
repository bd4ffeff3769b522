"""Session plumbing for the harness: batching of scenario calls per (world_size, tree).

Test modules register calls at import time with ``tests.harness.call(...)``; every call for the
same (world_size, tree) runs in one launched world the first time any of them is needed.
The ``world_results`` fixture is the functional form: ``world_results(world, tree, calls)``.
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.harness import bases, launcher, registry  # noqa: E402

# tests/unit_tests/ is materialized from patches/dev (upstream's layout, upstream's utilities):
# it runs inside a Megatron-LM checkout (results/dev-unit-tests/README.md), not in this suite.
collect_ignore = ['unit_tests']


@pytest.fixture(scope='session')
def world_results():
    """Functional access to the batched harness: world_results(world_size, tree, calls)."""
    return registry.world_results


@pytest.fixture(scope='session')
def harness_backend():
    """'gloo' (CPU ranks, default) or 'nccl' (FORK_TEST_BACKEND=nccl)."""
    return launcher.backend()


def pytest_report_header(config):
    return (
        f'harness backend: {launcher.backend()} (FORK_TEST_BACKEND); base: {bases.BASE} '
        f'(FORK_TEST_BASE; fork = {bases.FORK!r}, pristine = {bases.PRISTINE!r})'
    )


def pytest_terminal_summary(terminalreporter):
    """A rank that died takes its log with it on a CI machine: print the tail it left."""
    if launcher.DEATHS:
        terminalreporter.section('harness: ranks that exited with calls unfinished')
        for text in launcher.DEATHS:
            terminalreporter.write_line(text)
