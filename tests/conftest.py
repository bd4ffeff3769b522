"""Session plumbing for the harness: batching of scenario calls per (world_size, tree).

Test modules register calls at import time with ``tests.harness.call(...)``; every call for the
same (world_size, tree) runs in one launched world the first time any of them is needed.
The ``world_results`` fixture is the functional form: ``world_results(world, tree, calls)``.
"""

import collections
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.harness import bases, launcher, registry, tiers  # noqa: E402

# tests/unit_tests/ is materialized from patches/dev (upstream's layout, upstream's utilities):
# it runs inside a Megatron-LM checkout (evidence:dev-unit-tests/README.md), not in this suite.
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


SKIPS = collections.Counter()  # {tier: skipped tests} of this run


def _skip_text(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix('Skipped: ')
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip outside the optional tiers (tests/harness/tiers.py) fails, named in one line."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, 'wasxfail'):
        return
    text = _skip_text(report)
    tier = tiers.tier_of(text)
    if tier is None:
        report.outcome = 'failed'
        report.longrepr = (
            f'{item.nodeid}: skipped outside the optional tiers ({text}); install what it names '
            '(tools/install.sh --test-deps) or add the tier to tests/harness/tiers.py and '
            'docs/maintaining.md'
        )
    else:
        SKIPS[tier] += 1


def pytest_terminal_summary(terminalreporter):
    """Skips per tier; a rank that died takes its log with it on CI: print the tail it left."""
    if SKIPS:
        terminalreporter.section('skips by optional tier (docs/maintaining.md "Test tiers")')
        for tier, count in sorted(SKIPS.items()):
            terminalreporter.write_line(f'{count:5d}  {tier}: {tiers.TIERS[tier]}')
    log = os.environ.get('FORK_TEST_SKIP_LOG')
    if log:  # tools/test.sh totals the skips of its pytest runs
        with open(log, 'a', encoding='utf-8') as f:
            f.write(json.dumps({'base': bases.BASE, 'skips': dict(SKIPS)}) + '\n')
    if launcher.DEATHS:
        terminalreporter.section('harness: ranks that exited with calls unfinished')
        for text in launcher.DEATHS:
            terminalreporter.write_line(text)
