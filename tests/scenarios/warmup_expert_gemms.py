"""Issue 38: the routed experts' GEMM shapes that the warmup runs (warmup_expert_gemms.py).

One upstream ``TransformerLayer`` (local spec) with four ``SequentialMLP`` experts, top-2, on a
CPU rank. What cuBLAS caches is a GEMM's configuration (sizes, transposes, leading dimensions,
types); on the CPU the same configuration is what reaches ``aten.mm``: its operands' shapes,
strides and dtypes, recorded here with a dispatch mode. The widths are chosen so that only the
experts' GEMMs have an operand of 40 or 20 columns or rows (fc1 weight [40, 8], fc2 [8, 20]).
"""

import contextlib
import os
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SEED = 38057
HIDDEN, FFN, EXPERTS, TOPK = 8, 20, 4, 2
SEQ, MBS = 16, 2  # 32 tokens a micro-batch
EXPERT_DIMS = {2 * FFN, FFN}


class _MMRecorder(TorchDispatchMode):
    """Every aten.mm as (shape, stride, dtype) of both operands."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.calls.append(tuple((tuple(a.shape), a.stride(), str(a.dtype)) for a in args[:2]))
        return func(*args, **(kwargs or {}))


def _expert_gemms(calls):
    """The experts' GEMMs with tokens (an operand with an expert width; no empty product)."""
    return {
        c
        for c in calls
        if any(d in EXPERT_DIMS for shape, _, _ in c for d in shape)
        and all(d > 0 for shape, _, _ in c for d in shape)
    }


def _module():
    from tests.scenarios.common import import_with_real_cuda

    # megatron.training's package import pulls in modules that touch torch.cuda at import time
    import_with_real_cuda('megatron.training.training')
    from megatron.training import warmup_expert_gemms

    return warmup_expert_gemms


def _layer(experts=EXPERTS):
    import torch.nn.functional as F

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_router_topk=TOPK if experts else None,
        moe_router_load_balancing_type='none',
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    torch.manual_seed(SEED)
    return build_module(spec, config=config, layer_number=1), config


def _args():
    return SimpleNamespace(micro_batch_size=MBS, seq_length=SEQ, context_parallel_size=1)


def _step(layer, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=gen).requires_grad_()
    with _MMRecorder() as rec:
        out, _ = layer(x, attention_mask=None)
        out.pow(2).sum().backward()
    return _expert_gemms(rec.calls)


@contextlib.contextmanager
def _no_attention_rng():
    # Attention's dropout forks the CUDA RNG tracker, which has no state on a CPU rank (dropout 0).
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork  # a worker runs other files' cases next


def scenario_signatures(ctx):
    """The experts' GEMMs of two steps on random batches (the warmup's), of a step whose routing
    sends every token to the same two experts (a later model, or other data: 32 tokens an
    expert), and of the plan the warmup runs. Also whether the plan's run left the layer's
    params, grads and the RNG as they were."""
    from tests.scenarios.common import init_parallel

    weg = _module()
    init_parallel()
    with _no_attention_rng():
        layer, config = _layer()
        warm = _step(layer, 1) | _step(layer, 2)
        router = layer.mlp.router.weight
        with torch.no_grad():
            router.zero_()  # equal scores: the same top-2 experts for every token
        real = _step(layer, 3)
        params = {n: p.detach().clone() for n, p in layer.named_parameters()}
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        rng = torch.get_rng_state()
        plan = weg.plan_expert_gemms([layer], config, _args())
        with _MMRecorder() as rec:
            ran = weg.run_expert_gemms(plan)
    unchanged = (
        all(torch.equal(p, params[n]) for n, p in layer.named_parameters())
        and all(torch.equal(p.grad, grads[n]) for n, p in layer.named_parameters() if n in grads)
        and torch.equal(torch.get_rng_state(), rng)
    )
    return {
        'warm': sorted(warm),
        'real': sorted(real),
        'plan': sorted(_expert_gemms(rec.calls)),
        'plan_mm': len(rec.calls),
        'ran': ran,
        'num_gemms': plan.num_gemms,
        'unchanged': unchanged,
    }


def _plan_facts(plan):
    return {
        'weights': sorted(tuple(w.shape) for w in plan.weights),
        'counts': plan.token_counts,
        'max': plan.max_tokens,
        'mean': plan.mean_tokens,
        'ops': plan.ops_per_weight,
        'num_gemms': plan.num_gemms,
    }


def scenario_plan(ctx):
    """The plan for the layer under several settings, the token bounds under several layouts,
    and what prewarm_expert_gemms() runs for experts on the CPU (not a cuBLAS device)."""
    from tests.scenarios.common import init_parallel

    weg = _module()
    init_parallel()
    layer, config = _layer()
    out = {'default': _plan_facts(weg.plan_expert_gemms([layer], config, _args()))}
    saved = os.environ.get('CUBLASLT_HEURISTICS_CACHE_CAPACITY')
    os.environ['CUBLASLT_HEURISTICS_CACHE_CAPACITY'] = str(weg.RESERVED_ENTRIES + 2 * 3 * 5)
    try:
        out['room5'] = _plan_facts(weg.plan_expert_gemms([layer], config, _args()))
        os.environ['CUBLASLT_HEURISTICS_CACHE_CAPACITY'] = str(weg.RESERVED_ENTRIES - 1)
        out['no_room'] = _plan_facts(weg.plan_expert_gemms([layer], config, _args()))
    finally:
        if saved is None:
            del os.environ['CUBLASLT_HEURISTICS_CACHE_CAPACITY']
        else:
            os.environ['CUBLASLT_HEURISTICS_CACHE_CAPACITY'] = saved
    fused = SimpleNamespace(**{**vars(config), 'gradient_accumulation_fusion': True})
    out['fused_wgrad'] = _plan_facts(weg.plan_expert_gemms([layer], fused, _args()))
    # Two model chunks (virtual pipeline stages), each with its experts: one weight per shape.
    second, _ = _layer()
    out['two_chunks'] = _plan_facts(weg.plan_expert_gemms([layer, second], config, _args()))
    dense, dense_config = _layer(experts=None)
    out['dense'] = _plan_facts(weg.plan_expert_gemms([dense], dense_config, _args()))
    # An expert linear of another implementation (Transformer Engine's runs its own GEMMs).
    experts = layer.mlp.experts.local_experts
    saved_fc1 = [e.linear_fc1 for e in experts]
    for e in experts:
        e.linear_fc1 = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)
    out['other_fc1'] = _plan_facts(weg.plan_expert_gemms([layer], config, _args()))
    for e, fc1 in zip(experts, saved_fc1):
        e.linear_fc1 = fc1
    plan, seconds = weg.prewarm_expert_gemms([layer], config, _args())
    out['prewarm_cpu'] = {'num_gemms': plan.num_gemms, 'seconds': seconds}
    # Token bounds: micro-batch 2, sequence 16 (32 tokens), 4 experts, top-2.
    bounds = {}
    layouts = {
        'plain': {},
        'ep2': {'expert_model_parallel_size': 2},
        'sp_tp2': {'sequence_parallel': True, 'tensor_model_parallel_size': 2},
        'sp_tp2_etp1': {
            'sequence_parallel': True,
            'tensor_model_parallel_size': 2,
            'expert_tensor_parallel_size': 1,
        },
        'tp2_no_sp': {'tensor_model_parallel_size': 2},
        'cp2': {'cp': 2},
        'capacity': {'moe_expert_capacity_factor': 1.5},
        'capacity_rounded_up': {'moe_expert_capacity_factor': 1.1},
        'capacity_padded': {
            'moe_expert_capacity_factor': 1.5,
            'moe_pad_expert_input_to_capacity': True,
        },
        'ep2_capacity_padded': {
            'expert_model_parallel_size': 2,
            'moe_expert_capacity_factor': 1.02,
            'moe_pad_expert_input_to_capacity': True,
        },
    }
    for name, over in layouts.items():
        cfg = SimpleNamespace(
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            expert_model_parallel_size=1,
            sequence_parallel=False,
            tensor_model_parallel_size=1,
            expert_tensor_parallel_size=None,
            moe_expert_capacity_factor=None,
            moe_pad_expert_input_to_capacity=False,
        )
        args = _args()
        for k, v in over.items():
            if k == 'cp':
                args.context_parallel_size = v
            else:
                setattr(cfg, k, v)
        bounds[name] = list(weg.expert_token_bounds(cfg, args))
    out['bounds'] = bounds
    return out
