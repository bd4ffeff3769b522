"""Scenarios used by tests/tooling/test_harness.py to check the harness itself."""

import torch
import torch.distributed as dist


def scenario_info(ctx):
    """Report the world, tree and an all-reduced value."""
    import megatron.core

    t = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(t)
    return {
        'rank': ctx.rank,
        'world_size': ctx.world_size,
        'tree': ctx.tree,
        'core_file': megatron.core.__file__,
        'sum': t.item(),
        'backend': ctx.backend,
    }


def scenario_raise(ctx, message):
    """Raise a ValueError with a rank-specific message."""
    raise ValueError(f'{message} on rank {ctx.rank}')


def scenario_uncovered_cuda(ctx):
    """Touch a torch.cuda API the redirect does not cover."""
    return {'props': str(torch.cuda.get_device_properties(0))}


def scenario_redirected(ctx):
    """Exercise every redirected call and report what it produced."""
    x = torch.zeros(3, device='cuda')
    y = torch.ones(2, device=torch.cuda.current_device())
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.current_stream().wait_stream(s)
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    return {
        'zeros_device': str(x.device),
        'ones_device': str(y.device),
        'type_fp32': x.type(),
        'type_bf16': x.bfloat16().type(),
        'cuda_call_device': str(x.cuda().device),
        'to_device': str(x.to('cuda').device),
    }


def scenario_abort(ctx, rank, marker=None):
    """Rank ``rank`` writes a line and aborts (SIGABRT), the others return. With ``marker`` (a
    file path) the rank aborts only while the file does not exist, creating it first: once."""
    import os
    import sys

    if ctx.rank == rank and not (marker and os.path.exists(marker)):
        if marker:
            open(marker, 'w').close()
        sys.stderr.write(f'selftest: rank {rank} aborts now\n')
        sys.stderr.flush()
        os.abort()
    return {'rank': ctx.rank}


def scenario_exit(ctx, rank, code):
    """Rank ``rank`` leaves with ``os._exit(code)`` (no signal), the others return."""
    import os

    if ctx.rank == rank:
        os._exit(code)
    return {'rank': ctx.rank}
