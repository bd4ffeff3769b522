#!/usr/bin/env python
"""Reproduce the expert grad-norm / zero-count undercount of megatron-core's standard optimizer.

Smallest exact case: TP = EP = world size, ETP = 1, one replicated dense bf16 scalar and one
expert bf16 scalar (``allreduce=False``) per rank, i.e. ``world`` distinct experts. With every
gradient 1 the true global norm is sqrt(1 + world); with every gradient 0 the true zero count is
1 + world. Affected trees report sqrt(2) and 2 (the expert scalars are counted on dense TP rank 0
only).

Run (GPUs):  torchrun --nproc_per_node 2 tools/maint/expert_grad_stats_repro.py --tree . \
                 --expect fixed
Run (CPU):   torchrun --nproc_per_node 2 tools/maint/expert_grad_stats_repro.py --tree . \
                 --expect fixed --cpu
             (gloo; needs tests/harness/cpu_redirect.py from this repository)

Prints one JSON report (rank 0) and exits 1 when the observed status differs from --expect, 2 when
the imported megatron is not under --tree.
"""

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--tree', required=True, help='directory that contains megatron/')
    p.add_argument('--expect', required=True, choices=['bug', 'fixed'])
    p.add_argument('--cpu', action='store_true', help='CPU ranks over gloo (test CUDA redirect)')
    p.add_argument('--distributed-optimizer', action='store_true')
    return p.parse_args()


def main():
    """Build the exact case, run it, print the JSON report; exit 1 if the expectation fails."""
    args = _parse()
    tree = os.path.realpath(args.tree)
    if not os.path.isdir(os.path.join(tree, 'megatron')):
        sys.exit(f'--tree {tree} does not contain megatron/')
    sys.path.insert(0, tree)
    import torch
    import torch.distributed as dist

    if args.cpu:
        # Test-only redirect of torch.cuda onto CPU; lives in this repository's tests, not in
        # the shipped package.
        sys.path.insert(1, REPO)
        from tests.harness import cpu_redirect

        cpu_redirect.install()
        backend = 'gloo'
    else:
        torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', 0)))
        backend = 'nccl'

    import megatron.core

    core_file = os.path.realpath(megatron.core.__file__)
    if not core_file.startswith(tree + os.sep):
        print(
            json.dumps(
                {
                    'status': 'refused',
                    'reason': f'megatron.core imported from {core_file}, '
                    f'not from --tree {tree}',
                }
            )
        )
        sys.exit(2)

    dist.init_process_group(backend=backend)
    world, rank = dist.get_world_size(), dist.get_rank()

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(
        tensor_model_parallel_size=world,
        expert_model_parallel_size=world,
        expert_tensor_parallel_size=1,
    )
    device = torch.device('cpu') if args.cpu else torch.device('cuda', torch.cuda.current_device())

    class Tiny(torch.nn.Module):
        """One replicated dense scalar and one expert scalar (allreduce=False)."""

        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16, device=device))
            self.expert = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16, device=device))
            self.expert.allreduce = False

    heads = world * 2
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * 4,
        num_attention_heads=heads,
        tensor_model_parallel_size=world,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    model = DistributedDataParallel(
        cfg,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=args.distributed_optimizer
        ),
        Tiny(),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam',
            lr=0.0,
            bf16=True,
            use_distributed_optimizer=args.distributed_optimizer,
            clip_grad=0.0,
            log_num_zeros_in_grad=True,
        ),
        [model],
        use_gloo_process_groups=False,
    )
    children = list(getattr(opt, 'chained_optimizers', [opt]))

    def stats(value):
        for p in (model.module.dense, model.module.expert):
            p.main_grad.fill_(value)
        opt.prepare_grads()
        return float(opt.get_grad_norm()), int(opt.count_zeros())

    norm, _ = stats(1.0)
    _, zeros = stats(0.0)
    expected = {'norm': math.sqrt(1 + world), 'zeros': 1 + world}
    buggy = {'norm': math.sqrt(2), 'zeros': 2}

    def matches(ref):
        return math.isclose(norm, ref['norm'], rel_tol=1e-6) and zeros == ref['zeros']

    observed = 'fixed' if matches(expected) else ('bug' if matches(buggy) else 'unexpected')
    report = {
        'tree': tree,
        'megatron_core': core_file,
        'world_size': world,
        'distributed_optimizer': args.distributed_optimizer,
        'groups': {
            'tp': ps.get_tensor_model_parallel_world_size(),
            'ep': ps.get_expert_model_parallel_world_size(),
            'etp': ps.get_expert_tensor_parallel_world_size(),
            'expert_dp': ps.get_expert_data_parallel_world_size(),
        },
        'norm': norm,
        'zeros': zeros,
        'expected_norm': expected['norm'],
        'expected_zeros': expected['zeros'],
        'bug_norm': buggy['norm'],
        'bug_zeros': buggy['zeros'],
        'optimizers': [type(c).__name__ for c in children],
        'expert_tp_group_attached': [
            getattr(c, 'expert_tp_group', None) is not None for c in children
        ],
        'allreduce_seen_by_optimizers': [
            [getattr(p, 'allreduce', None) for p in c.get_parameters()] for c in children
        ],
        'observed': observed,
        'expect': args.expect,
    }
    if rank == 0:
        print(json.dumps(report, indent=2))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    sys.exit(0 if observed == args.expect else 1)


if __name__ == '__main__':
    main()
