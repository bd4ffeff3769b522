"""Issue 38: torch.compile recompiles of the MoE experts' fused activations, per step.

Upstream's ``MoELayer`` (local spec: ``SequentialMLP`` experts, SwiGLU with
``bias_activation_fusion``, no linear biases) runs forward and backward for a list of steps. The
router weight is set so that the routing is chosen by the input: ``counts[e]`` tokens are routed
first to expert ``e`` and second to ``e + 1`` (mod the expert count), so expert ``e`` receives
``counts[e - 1] + counts[e]`` tokens and every step's per-expert counts are known in advance.
The steps change those counts the way real data does: new counts, an expert with one token or
none, a probs slice that starts at offset 1.

After each step the scenario reads how many graphs dynamo holds for each fused activation (its
cache entries for the function's code): a graph compiled in a step after the first is a recompile
mid-run. ``torch.compile`` is what ``jit_fuser`` is on every torch this runs on, and inductor
compiles for the CPU here, so these are the same compiles a GPU run makes (no timing is read).

The gradients of the layer's parameters and input are also returned, from the compiled run, and
from the same layer and steps in float64 with the fused functions run eagerly (the reference), and
float32 eager (the rounding bound).
"""

import contextlib
import inspect

import torch

HIDDEN = 8
FFN = 16
SEED = 38038
# Per activation: the module and the fused functions of routed tokens that a MoE step calls
# (forward, backward). 'quick_geglu_bias' is quick-GeGLU with linear biases (the bias variant).
FUNCTIONS = {
    'swiglu': ('fused_bias_swiglu', ('weighted_swiglu', 'weighted_swiglu_back')),
    'quick_geglu': ('fused_bias_geglu', ('weighted_quick_geglu', 'weighted_quick_geglu_back')),
    'quick_geglu_bias': (
        'fused_bias_geglu',
        ('weighted_bias_quick_geglu', 'weighted_bias_quick_geglu_back'),
    ),
    'squared_relu': (
        'fused_weighted_squared_relu',
        ('weighted_squared_relu', 'weighted_squared_relu_back'),
    ),
}


def _config(experts, dispatcher, dtype, activation, ep=1):
    import torch.nn.functional as F

    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        expert_model_parallel_size=ep,
        num_moe_experts=experts,
        moe_router_topk=2,
        moe_router_dtype='fp64' if dtype == torch.float64 else 'fp32',
        moe_router_load_balancing_type='none',
        moe_token_dispatcher_type=dispatcher,
        add_bias_linear=activation == 'quick_geglu_bias',
        gated_linear_unit=True,
        activation_func=F.silu if activation == 'swiglu' else quick_gelu,
        bias_activation_fusion=True,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )


def _tokens(counts, experts, dtype):
    """[sum(counts), 1, HIDDEN]: counts[e] tokens routed to experts e (first) and e + 1."""
    rows = []
    for e, count in enumerate(counts):
        row = torch.zeros(HIDDEN, dtype=dtype)
        row[e] = 2.0
        row[(e + 1) % experts] = 1.0
        row[experts:] = 0.25 * (e + 1)  # the experts see different inputs
        rows += [row] * count
    return torch.stack(rows).unsqueeze(1)


def _graphs(activation):
    """Graphs dynamo holds per fused function of ``activation`` (0 before its first compile)."""
    import importlib

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    module, names = FUNCTIONS[activation]
    module = importlib.import_module(f'megatron.core.fusions.{module}')
    return {
        name: len(_debug_get_cache_entry_list(inspect.unwrap(getattr(module, name))))
        for name in names
    }


def _nested_graphs():
    """Graphs of their own of ``swiglu`` and ``swiglu_back``, which the weighted SwiGLU functions
    call: inlined where those compile, eager where they run eagerly, so none."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from megatron.core.fusions import fused_bias_swiglu

    return {
        name: len(_debug_get_cache_entry_list(inspect.unwrap(getattr(fused_bias_swiglu, name))))
        for name in ('swiglu', 'swiglu_back')
    }


def _build(experts, dispatcher, dtype, ep, activation):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(experts, dispatcher, dtype, activation, ep=ep)
    layer = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False).submodules.mlp(
        config=config
    )
    with torch.no_grad():
        for name, p in layer.named_parameters():
            digest = sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**31
            gen = torch.Generator().manual_seed(SEED + digest)
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5).to(dtype))
        # Route by the input's first `experts` features alone (see _tokens).
        layer.router.weight.copy_(torch.eye(experts, HIDDEN, dtype=dtype) * 10)
    return layer


def _run(steps, experts, dispatcher, dtype, ep, rank, compiled, activation):
    """Forward and backward of the layer for each step's counts on this rank; per step: the graphs
    compiled in it, the grads of params and input."""
    layer = _build(experts, dispatcher, dtype, ep, activation)
    per_step = []
    before = _graphs(activation)
    for counts in steps:
        counts = counts[rank] if isinstance(counts[0], list) else counts
        x = _tokens(counts, experts, dtype).requires_grad_()
        layer.zero_grad()
        if compiled:
            out, _ = layer(x)
        else:
            with torch.compiler.set_stance('force_eager'):
                out, _ = layer(x)
        probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        (out.double() * probe).sum().backward()
        after = _graphs(activation)
        grads = {n: p.grad.double().flatten().tolist() for n, p in layer.named_parameters()}
        grads['input'] = x.grad.double().flatten().tolist()
        per_step.append(
            {'counts': counts, 'compiled': {k: after[k] - before[k] for k in after}, 'grads': grads}
        )
        before = after
    return per_step, after


def _small_elements():
    """The fork's ``routed_token_fuser.SMALL_ELEMENTS`` as it stands (None on pristine)."""
    try:
        from megatron.core.fusions import routed_token_fuser
    except ImportError:  # pristine
        return None
    return routed_token_fuser.SMALL_ELEMENTS


@contextlib.contextmanager
def _small(small):
    """The fork's ``routed_token_fuser.SMALL_ELEMENTS`` (below it the experts' forward activations
    run eagerly) set to ``small`` where given, and put back after: a worker runs the cases of
    other files after this one."""
    try:
        from megatron.core.fusions import routed_token_fuser
    except ImportError:  # pristine
        yield
        return
    shipped = routed_token_fuser.SMALL_ELEMENTS
    routed_token_fuser.SMALL_ELEMENTS = shipped if small is None else small
    try:
        yield
    finally:
        routed_token_fuser.SMALL_ELEMENTS = shipped


def scenario_recompiles(
    ctx,
    steps,
    experts=4,
    dispatcher='allgather',
    ep=1,
    activation='swiglu',
    reference=True,
    small=None,
):
    """Run ``steps`` (each a list of per-expert counts, or a list of them per rank) through a MoE
    layer at EP = ``ep`` (the world) with ``activation`` ('swiglu', 'quick_geglu' or
    'quick_geglu_bias'), compiled; with ``reference``, also float32 and float64 eager. ``small``:
    the fork's ``SMALL_ELEMENTS`` (0: every forward call of 2 or more tokens compiled). Returns
    'steps' (per step: counts, graphs compiled per function, grads), 'graphs' (held at the end
    per function), 'small_elements' (the threshold the compiled run saw), and 'eager32', 'ref64'
    (per step: grads)."""
    from tests.scenarios.common import init_parallel

    init_parallel(ep=ep)
    torch._dynamo.reset()  # no graph of an earlier call in this world stands in for this one's
    args = (experts, dispatcher)
    with _small(small):
        per_step, graphs = _run(steps, *args, torch.float32, ep, ctx.rank, True, activation)
        threshold = _small_elements()
    res = {
        'steps': per_step,
        'graphs': graphs,
        'nested': _nested_graphs(),
        'small_elements': threshold,
    }
    if reference:
        for key, dtype in (('eager32', torch.float32), ('ref64', torch.float64)):
            eager, _ = _run(steps, *args, dtype, ep, ctx.rank, False, activation)
            res[key] = [s['grads'] for s in eager]
    return res


def scenario_squared_relu_recompiles(ctx, counts, small=None):
    """The weighted squared ReLU as the grouped experts call it (once per step on all the tokens
    a rank received; only the grouped path uses it, which needs Transformer Engine): per step
    the graphs compiled, and the largest difference of output and grads from eager; and
    'small_elements', the threshold the steps saw."""
    with _small(small):
        return dict(_squared_relu_steps(counts), small_elements=_small_elements())


def scenario_small_elements(ctx, small):
    """The fork's ``SMALL_ELEMENTS`` as this call finds it ('shipped'; a value that an earlier
    case of this worker left behind shows here), and around cases of the scenarios above that
    set it (the MoE layer's, the squared ReLU's, and a squared ReLU case that raises), each at a
    threshold of its own (``small``, ``small + 1``, ``small + 2``): the value it found
    ('before'), ran at ('during'; 'error' for the one that raises) and left ('after'). A case that
    leaves its threshold behind thus leaves another value than it found, whatever ran before.
    Every case is one token an expert or none, which runs eagerly at any threshold: nothing
    compiles."""

    def around(threshold, case, **kwargs):
        seen = {'before': _small_elements()}
        try:
            seen['during'] = case(ctx, small=threshold, **kwargs)['small_elements']
        except RuntimeError as exc:  # a negative count: torch.randn raises inside the case
            seen['error'] = f'{type(exc).__name__}: {exc}'
        seen['after'] = _small_elements()
        return seen

    shipped = _small_elements()
    cases = {
        'recompiles': around(small, scenario_recompiles, steps=[[1, 0, 1, 0]], reference=False),
        'squared_relu': around(small + 1, scenario_squared_relu_recompiles, counts=[1]),
        'raised': around(small + 2, scenario_squared_relu_recompiles, counts=[-1]),
    }
    return {'shipped': shipped, 'cases': cases}


def _squared_relu_steps(counts):
    from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl

    torch._dynamo.reset()
    per_step, before = [], _graphs('squared_relu')
    for n in counts:
        gen = torch.Generator().manual_seed(SEED + n)
        x, probs = torch.randn(n, FFN, generator=gen), torch.rand(n, generator=gen)
        outs = {}
        for mode in ('compiled', 'eager'):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            with torch.compiler.set_stance('force_eager' if mode == 'eager' else 'default'):
                out = weighted_squared_relu_impl(xi, pi.unsqueeze(-1))
                out.pow(2).sum().backward()
            outs[mode] = (out.detach(), xi.grad, pi.grad)
            if mode == 'compiled':
                after = _graphs('squared_relu')
        diff = max((a - b).abs().max().item() if a.numel() else 0.0 for a, b in zip(*outs.values()))
        per_step.append({'compiled': {k: after[k] - before[k] for k in after}, 'diff': diff})
        before = after
    return {'steps': per_step}
