"""DDP + (distributed) optimizer training scenarios against a float64 reference."""

from tests.scenarios.common import init_parallel, train_steps


def scenario_train(ctx, parallel=None, **kwargs):
    """Initialise parallel state (default pure DP) and run common.train_steps(**kwargs)."""
    init_parallel(**(parallel or {}))
    return train_steps(ctx, **kwargs)
