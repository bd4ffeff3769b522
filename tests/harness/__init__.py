"""CPU-rank (gloo) / GPU (nccl) test harness running unmodified megatron trees.

See tests/harness/README.md for the contract and how to add scenarios and tests.
"""

from tests.harness.launcher import HarnessError, TreeShadowedError, run_world
from tests.harness.registry import Call, call, skip_reason, world_results

__all__ = [
    'Call',
    'HarnessError',
    'TreeShadowedError',
    'call',
    'run_world',
    'skip_reason',
    'world_results',
]
