# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The routed experts' GEMM shapes, run once after the ``--warmup-train-steps`` steps.

cuBLAS picks a kernel for each new GEMM shape on the host and keeps its choice in a cache of
8192 entries (``CUBLASLT_HEURISTICS_CACHE_CAPACITY``); the first call of a shape costs several
times the host time of a repeat. ``SequentialMLP`` multiplies each local expert's tokens on their
own, so every token count an expert receives is a shape of its own, three times (forward, input
gradient, weight gradient) in each of its two linear layers. A MoE step that waits on the host
pays for the counts it has not met yet through its first tens of iterations, and the warmup's
synthetic batches are routed differently from the real ones, so its steps leave most of them.

:func:`prewarm_expert_gemms` runs these GEMMs once for the token counts an expert is likeliest to
receive (its mean share of the routed tokens and the counts around it), as many as fit the cache
with room left for the rest of the model, the likeliest last (the cache keeps the newest). The
products are discarded: no parameter, gradient, optimizer or RNG state changes, and the real
steps pick the same kernels as without it (the choice depends on the shape only).
"""

import os
import time
from dataclasses import dataclass
from typing import List, Tuple

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import get_capacity

# cuBLAS's default heuristics cache size, and the entries left to the model's other GEMMs.
DEFAULT_CACHE_CAPACITY = 8192
RESERVED_ENTRIES = 1024


@dataclass
class ExpertGemmPlan:
    """What prewarm_expert_gemms() runs: each distinct expert weight once per token count."""

    weights: List[torch.Tensor]
    token_counts: List[int]
    max_tokens: int
    mean_tokens: float
    ops_per_weight: int

    @property
    def num_gemms(self) -> int:
        """GEMMs (cache entries) of the plan."""
        return len(self.weights) * self.ops_per_weight * len(self.token_counts)


def _local_expert_weights(model) -> List[torch.Tensor]:
    """One weight of each distinct (shape, dtype, device) among the local linear layers of the
    SequentialMLP experts (Transformer Engine's layers run their own GEMMs: left out)."""
    seen, weights = set(), []
    for chunk in model:
        for module in chunk.modules():
            if not isinstance(module, SequentialMLP):
                continue
            for expert in module.local_experts:
                for linear in (expert.linear_fc1, expert.linear_fc2):
                    if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                        continue
                    weight = linear.weight
                    key = (tuple(weight.shape), weight.dtype, weight.device)
                    if key not in seen:
                        seen.add(key)
                        weights.append(weight)
    return weights


def expert_token_bounds(config, args) -> Tuple[int, float]:
    """(most tokens one local expert can receive in a micro-batch, its mean share).

    A rank's router sees its micro-batch's tokens (``args``: micro-batch size and sequence, less
    context parallelism, less tensor parallelism under sequence parallelism); the dispatcher
    brings an expert the tokens of the expert-parallel and expert-tensor-parallel ranks, each
    routed to it at most once and ``moe_router_topk`` times in all. With a capacity factor each
    rank sends an expert at most its capacity (upstream's ``get_capacity``), exactly that when
    padded to capacity."""
    tp = config.tensor_model_parallel_size
    etp = getattr(config, 'expert_tensor_parallel_size', None) or tp
    ranks = config.expert_model_parallel_size * etp
    local = args.micro_batch_size * args.seq_length // max(args.context_parallel_size, 1)
    local //= tp if config.sequence_parallel else 1
    tokens = local * ranks
    mean = tokens * config.moe_router_topk / config.num_moe_experts
    capacity_factor = getattr(config, 'moe_expert_capacity_factor', None)
    if capacity_factor is not None:
        topk, experts = config.moe_router_topk, config.num_moe_experts
        capacity = get_capacity(local * topk, experts, capacity_factor) * ranks
        if getattr(config, 'moe_pad_expert_input_to_capacity', False):
            return capacity, float(capacity)
        tokens = min(tokens, capacity)
    return tokens, mean


def cache_capacity() -> int:
    """cuBLAS's heuristics cache size as this process set it (the variable, else the default)."""
    value = os.environ.get('CUBLASLT_HEURISTICS_CACHE_CAPACITY', '')
    return int(value) if value.isdigit() else DEFAULT_CACHE_CAPACITY


def plan_expert_gemms(model, config, args) -> ExpertGemmPlan:
    """The token counts to run, likeliest last, within the cache's room (see the module)."""
    weights = _local_expert_weights(model)
    if not weights or not config.num_moe_experts:
        return ExpertGemmPlan([], [], 0, 0.0, 0)
    max_tokens, mean = expert_token_bounds(config, args)
    # The fused weight-gradient kernel (apex) runs its own GEMM: forward and input gradient only.
    ops = 2 if getattr(config, 'gradient_accumulation_fusion', False) else 3
    room = max(cache_capacity() - RESERVED_ENTRIES, 0) // (len(weights) * ops)
    counts = sorted(range(1, max_tokens + 1), key=lambda m: (abs(m - mean), -m), reverse=True)
    return ExpertGemmPlan(
        weights, counts[len(counts) - min(room, len(counts)) :], max_tokens, mean, ops
    )


# The devices whose GEMMs go through cuBLAS's shape cache (a test adds 'cpu' to run the plan there).
PREWARM_DEVICES = ('cuda',)


@torch.no_grad()
def run_expert_gemms(plan: ExpertGemmPlan) -> int:
    """Each GEMM of ``plan`` once, as the local linear layers run it (``x @ W.t()``, ``g @ W``,
    ``g.t() @ x``), on zero inputs; returns the GEMMs run."""
    if not plan.token_counts:
        return 0
    top = max(plan.token_counts)
    inputs = []
    for weight in plan.weights:
        w = weight.detach()
        x = torch.zeros(top, w.shape[1], dtype=w.dtype, device=w.device)
        g = torch.zeros(top, w.shape[0], dtype=w.dtype, device=w.device)
        inputs.append((w, x, g))
    for m in plan.token_counts:
        for w, x, g in inputs:
            torch.matmul(x[:m], w.t())
            g[:m].matmul(w)
            if plan.ops_per_weight == 3:
                g[:m].t().matmul(x[:m])
    return plan.num_gemms


def prewarm_expert_gemms(model, config, args) -> Tuple[ExpertGemmPlan, float]:
    """Plan and run the experts' GEMM shapes; (plan run, seconds). Nothing runs for a model
    without a local SequentialMLP expert, or with its experts on a device not in
    ``PREWARM_DEVICES``."""
    plan = plan_expert_gemms(model, config, args)
    if not plan.weights or plan.weights[0].device.type not in PREWARM_DEVICES:
        return ExpertGemmPlan([], [], plan.max_tokens, plan.mean_tokens, 0), 0.0
    start = time.perf_counter()
    run_expert_gemms(plan)
    if plan.weights[0].is_cuda:
        torch.cuda.synchronize()
    return plan, time.perf_counter() - start


def warmup_expert_gemms(model, config, args) -> Tuple[ExpertGemmPlan, float]:
    """train()'s call right after run_warmup(): with ``--warmup-train-steps`` N > 0, run the
    experts' GEMM shapes (last, so that the GPU stays busy until the first real step) and log
    what ran."""
    from megatron.training.utils import print_rank_0

    if not getattr(args, 'warmup_train_steps', 0):
        return ExpertGemmPlan([], [], 0, 0.0, 0), 0.0
    plan, seconds = prewarm_expert_gemms(model, config, args)
    if plan.token_counts:
        print_rank_0(
            f'[warmup] Ran {plan.num_gemms} routed-expert GEMM shapes in {seconds:.2f}s: '
            f'{min(plan.token_counts)}-{max(plan.token_counts)} tokens an expert (of up to '
            f'{plan.max_tokens}, mean {plan.mean_tokens:.0f}), {len(plan.weights)} weight '
            f'shapes, cuBLAS heuristics cache of {cache_capacity()}'
        )
    return plan, seconds
