"""The README's demo table is what tools/demo.py prints now (issue: the two must not drift).

The demo's calls are registered with ``reuse=True`` and the same kwargs as the test files' own
calls, so most of what this reads is computed by the suite anyway. It renders the table with the
demo's own code and compares it with the block between the README's demo-table markers; on a
mismatch, run ``tools/demo.py --readme`` and commit the README.
"""

import difflib
import importlib.util
from pathlib import Path

from tests.harness import bases, launcher, tiers

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location('fork_demo', REPO / 'tools' / 'demo.py')
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

WORLD = 2  # the README's table is the CPU one: 2 gloo ranks
HANDLES = (
    {base: demo.register(WORLD, base) for base in bases.RELEASES}
    if launcher.backend() == 'gloo'
    else {}
)
pytestmark = tiers.skipif(
    launcher.backend() != 'gloo', 'nccl', "the README's demo table is the gloo (CPU) one"
)


def _results():
    return {base: demo.collect(h) for base, h in HANDLES.items()}


def test_demo_rows_show_the_expected_outcomes():
    assert demo.all_expected(WORLD, _results())


def test_readme_table_is_what_the_demo_prints():
    table = demo.render(WORLD, _results())
    readme = demo.readme_table()
    diff = '\n'.join(difflib.unified_diff(readme.splitlines(), table.splitlines(), lineterm=''))
    assert readme == table, f'README demo table is stale; run tools/demo.py --readme\n{diff}'
