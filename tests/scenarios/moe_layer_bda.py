"""Issue 38: which transformer layers compile the fused bias-dropout-add.

One upstream ``TransformerLayer`` (local spec, ``bias_dropout_fusion`` on), with a MoE MLP (four
``SequentialMLP`` experts, top-2) or a dense one, runs a forward and backward step on a CPU rank
(or, in eval mode, a forward step), compiled by ``jit_fuser`` as on a GPU. The dense layer is built
either in a dense model or, as ``moe_layer_freq`` builds it, from the dense spec in a model whose
config has experts. The scenario reads how many graphs dynamo holds for the fused function after
the step (``bias_dropout_add_fused_train``, or ``_inference`` in eval mode), and the layer's output
and input grad against the same step with every fused function eager.
"""

import contextlib
import inspect

import torch

from tests.scenarios.moe_recompiles import _small, _small_elements

SEED = 38039


def _graphs(training):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from megatron.core.fusions import fused_bias_dropout

    fn = (
        fused_bias_dropout.bias_dropout_add_fused_train
        if training
        else fused_bias_dropout.bias_dropout_add_fused_inference
    )
    return len(_debug_get_cache_entry_list(inspect.unwrap(fn)))


def _layer(experts, spec_experts, mlp_bda=None, moe_layer_class=False):
    import torch.nn.functional as F

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=16,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_router_topk=2 if experts else None,
        moe_router_load_balancing_type='none',
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=spec_experts, moe_grouped_gemm=False)
    if mlp_bda is not None:
        spec.submodules.mlp_bda = mlp_bda
    if moe_layer_class:  # the layer class of the partial CUDA graphs (hybrid specs use it)
        from megatron.core.transformer.transformer_layer import MoETransformerLayer

        spec.module = MoETransformerLayer
    torch.manual_seed(SEED)
    return build_module(spec, config=config, layer_number=1)


def _step(layer, seed, eager):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 1, 8, generator=gen).requires_grad_(layer.training)
    with torch.compiler.set_stance('force_eager') if eager else contextlib.nullcontext():
        out, _ = layer(x, attention_mask=None)
        if not layer.training:
            return (out,)
        out.pow(2).sum().backward()
    return out.detach(), x.grad


def scenario_bda_graphs(
    ctx, experts, small=None, training=True, dense_layer=False, moe_layer_class=False
):
    """Graphs of the fused bias-dropout-add after a step of one layer (``experts`` 0: a dense
    model; ``dense_layer``: the dense layer of a model with ``experts``; ``training`` False: a
    forward step in eval mode; ``moe_layer_class``: built as ``MoETransformerLayer``, without CUDA
    graphs), at the fork's ``SMALL_ELEMENTS`` = ``small`` where given; and the
    largest difference of the output (and the input grad) from the same step with every fused
    function eager (dropout 0, so that both draw no random numbers)."""
    from megatron.core import tensor_parallel
    from tests.scenarios.common import init_parallel

    init_parallel()
    torch._dynamo.reset()
    # Attention's dropout forks the CUDA RNG tracker, which has no state on a CPU rank: a no-op
    # (attention dropout is 0 in these layers).
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        with _small(small):
            threshold = _small_elements()
            layer = _layer(
                experts or None,
                None if dense_layer else experts or None,
                moe_layer_class=moe_layer_class,
            )
            layer.train(training)
            # the layer asks its getters for the function on every call: one function each
            same = all(
                bda(training, True) is bda(training, True)
                for bda in (layer.self_attn_bda, layer.mlp_bda)
            )
            compiled = _step(layer, SEED, eager=False)
            graphs = _graphs(training)
            eager = _step(layer, SEED, eager=True)
    finally:
        del tracker.fork  # a worker runs other files' cases next
    diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(compiled, eager))
    return {'graphs': graphs, 'diff': diff, 'small_elements': threshold, 'same_function': same}


def scenario_bda_in_compiled_region(ctx, small):
    """The function a MoE layer's bias-dropout-add getter returns, called in a region that
    torch.compile compiles whole with dynamic shapes (as a layer compiled whole is), over
    residuals of [n, 1, 8] on both sides of the fork's ``SMALL_ELEMENTS`` = ``small``: the frames
    dynamo compiled (one on pristine: the region holds the fused function at every size) and the
    largest difference from x + residual (dropout 0)."""
    from torch._dynamo.testing import CompileCounter

    from tests.scenarios.common import init_parallel

    init_parallel()
    torch._dynamo.reset()
    counter = CompileCounter()
    diff = 0.0
    with _small(small):
        bda = _layer(4, 4).mlp_bda(True, True)
        region = torch.compile(
            lambda x, residual: bda((x, None), residual, 0.0), backend=counter, dynamic=True
        )
        gen = torch.Generator().manual_seed(SEED)
        for n in (small // 16, small // 2, small // 32, small):  # below, above, below, above
            x, residual = torch.randn(2, n, 1, 8, generator=gen)
            diff = max(diff, (region(x, residual) - (x + residual)).abs().max().item())
    return {'frames': counter.frame_count, 'diff': diff}


def scenario_other_bda_getter(ctx):
    """A MoE layer whose spec gives ``mlp_bda`` as a getter other than upstream's
    ``get_bias_dropout_add`` (``IdentityFuncOp``): whether the layer holds that module as built."""
    from megatron.core.transformer.identity_op import IdentityFuncOp
    from tests.scenarios.common import init_parallel

    init_parallel()
    layer = _layer(4, 4, mlp_bda=IdentityFuncOp)
    return {'kept': isinstance(layer.mlp_bda, IdentityFuncOp)}


def scenario_jit_fuser_off(ctx, off):
    """Where upstream's ``jit_fuser`` is not ``torch.compile``: ``off`` 'jit' disables it as
    ``--disable-jit-fuser`` does (``megatron.core.jit.disable_jit_fuser()``: a no-op decorator);
    'set_stance' leaves it on in a torch without ``torch.compiler.set_stance``. The fused SwiGLU
    module is executed anew under that setting (a module object of its own, the loaded one is
    untouched), and a MoE layer is built. Returns, per weighted SwiGLU function, what decorated it
    (``plain``: the function itself; ``compiled``: ``torch.compile``'s wrapper; ``other``: a
    wrapper of anyone else's) and whether the layer holds upstream's bias-dropout-add getter."""
    import importlib.util
    import sys

    from megatron.core import jit
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from tests.scenarios.common import init_parallel

    init_parallel()
    saved = jit.jit_fuser, torch.compiler.set_stance
    if off == 'jit':
        jit.disable_jit_fuser()
    else:
        del torch.compiler.set_stance
    try:
        spec = importlib.util.spec_from_file_location(
            'moe_layer_bda_fused_bias_swiglu', fused_bias_swiglu.__file__
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # what its classes' definitions look up
        spec.loader.exec_module(module)
        layer = _layer(4, 4)
    finally:
        sys.modules.pop('moe_layer_bda_fused_bias_swiglu', None)
        jit.jit_fuser, torch.compiler.set_stance = saved  # a worker runs other files' cases next

    def kind(fn):
        if hasattr(fn, '_torchdynamo_orig_callable'):
            return 'compiled'
        return 'other' if hasattr(fn, '__wrapped__') else 'plain'

    names = ('weighted_swiglu', 'weighted_swiglu_back')
    return {
        'kinds': {name: kind(getattr(module, name)) for name in names},
        'upstream_getter': layer.mlp_bda is get_bias_dropout_add,
    }
