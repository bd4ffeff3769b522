# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""``jit_fuser`` for the fused activations of routed tokens: one compiled graph for every token
count.

The weighted activations of MoE experts (``weighted_swiglu``, ``weighted_quick_geglu``,
``weighted_squared_relu`` and their backward functions) run on the tokens routed to one expert
(``SequentialMLP`` calls them once per local expert) or to one rank (grouped experts with
EP > 1). That count changes from step to step with the data. ``torch.compile`` specializes on it:
the first call compiles a static shape, the second count recompiles with a dynamic one, and
counts of 0 and 1 and storage offsets of 0 and 1 (the per-expert slices of the routing probs)
each get a graph of their own, so new graphs keep being compiled mid-run until the recompile
limit (8 per function) sends the rest to eager.

``routed_token_fuser(*names)`` compiles like ``jit_fuser`` and marks dimension 0 of the named
tensor arguments dynamic on every call (``torch._dynamo.maybe_mark_dynamic``: a hint, never an
error), so the first call traces the one graph that every later count of 2 or more tokens runs
(the graph that pristine reaches after its first recompiles and keeps for such counts). Counts
of 0 and 1, whose graphs would be specializations of their own, run the same function eagerly
(``torch.compiler.set_stance("force_eager")``): there is at most one token to compute. The fused
functions are called inside autograd functions, with grad mode off; there the tensors are also
passed detached (dynamo guards on a view's base and on ``requires_grad``). The probs slices of
the experts start at the storage offset of the tokens before them. With dimension 0 marked,
that offset costs at most one more graph, in the first step (the backward meets the slices in
reverse order, an offset of 2 or more before the first expert's 0), and that graph serves every
later offset, 1 included, so the slices are passed without a copy.

(``torch._dynamo.decorators.mark_unbacked`` would take 0 and 1 into the graph too, but its
kernels cannot assume 32-bit indexing, and they ran slower than those of a dynamic count.)

Per call, a compiled function costs host time (dynamo's guards, the compiled graph's wrapper, the
kernel launch) that a few eager operations do not. A MoE step makes one such call per expert,
layer and direction, on few tokens each, and is bound by the host. The forward functions, a few
elementwise operations each, are therefore marked ``eager_if_small``: they run eagerly where their
first token argument holds fewer than ``SMALL_ELEMENTS`` elements, and compiled above it, where
the fused kernel's saved memory passes outweigh that cost. The backward functions, about a dozen
operations eagerly, stay compiled at every size.

The same host cost makes ``bias_dropout_add_fused_train`` (compiled with grad: AOTAutograd's
wrapper in the forward and in the backward) slower than its few eager operations in a MoE layer,
where the step waits on the host. ``moe_bias_dropout_add`` gives a MoE layer the unfused function
below ``SMALL_ELEMENTS`` elements of the residual; dense layers keep the fused one.
"""

import functools
import inspect

import torch

from megatron.core import jit
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add


def _routed(arg):
    """``arg`` as the compiled function should see it: dimension 0 dynamic, and the same guards on
    every call.

    Inside an autograd function (grad mode off) ``arg`` is detached (no view base whose size
    dynamo would guard on, and the same ``requires_grad`` whether or not the caller's tensor has
    it).
    """
    if not isinstance(arg, torch.Tensor) or arg.dim() == 0:
        return arg
    if not torch.is_grad_enabled():
        arg = arg.detach()
    torch._dynamo.maybe_mark_dynamic(arg, 0)
    return arg


# A forward function decorated with ``eager_if_small=True`` runs eagerly on fewer elements than
# this in its first token argument (1 << 24: 2048 tokens of a 4096-wide SwiGLU input).
SMALL_ELEMENTS = 1 << 24


def routed_token_fuser(*token_args, eager_if_small=False):
    """Decorator: ``jit_fuser`` with dimension 0 of the arguments named ``token_args`` marked as a
    data-dependent token count where they are passed by position (as every caller in megatron
    does); calls with fewer than 2 tokens run eagerly, and so do calls with fewer than
    ``SMALL_ELEMENTS`` elements in the first token argument where ``eager_if_small`` is set.

    Where ``jit_fuser`` is not ``torch.compile`` (older torch: TorchScript; or a no-op), or torch
    has no ``torch.compiler.set_stance``, the function is decorated by ``jit_fuser`` alone.
    """

    def decorate(fn):
        compiled = jit.jit_fuser(fn)
        if jit.jit_fuser is not torch.compile or not hasattr(torch.compiler, 'set_stance'):
            return compiled
        positions = [list(inspect.signature(fn).parameters).index(name) for name in token_args]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return compiled(*args, **kwargs)
            tokens = [args[i] for i in positions if i < len(args)]
            tokens = [t for t in tokens if isinstance(t, torch.Tensor) and t.dim() > 0]
            if any(t.size(0) < 2 for t in tokens) or (
                eager_if_small and tokens and tokens[0].numel() < SMALL_ELEMENTS
            ):
                # fn itself, not its compiled wrapper; the stance keeps the compiled functions
                # it calls (swiglu) eager too.
                with torch.compiler.set_stance('force_eager'):
                    return fn(*args, **kwargs)
            args = [_routed(a) if i in positions else a for i, a in enumerate(args)]
            return compiled(*args, **kwargs)

        return call

    return decorate


def moe_bias_dropout_add(get_bda):
    """A MoE layer's bias-dropout-add getter (``get_bda(training, fused)``, as the layer calls
    ``self.mlp_bda``): where ``get_bda`` is ``get_bias_dropout_add`` and the fused function is
    ``torch.compile``d, the fused function returned runs the unfused one on a residual of fewer
    than ``SMALL_ELEMENTS`` elements. Any other getter is returned as it is.
    """
    if get_bda is not get_bias_dropout_add or jit.jit_fuser is not torch.compile:
        return get_bda

    @functools.wraps(get_bda)
    @functools.lru_cache(maxsize=None)  # one function per (training, fused), not one per call
    def get(training, fused):
        bda = get_bda(training, fused)
        if not fused:
            return bda
        unfused = get_bda(training, False)

        def call(x_with_bias, residual, prob):
            if not torch.compiler.is_compiling() and residual.numel() < SMALL_ELEMENTS:
                return unfused(x_with_bias, residual, prob)
            return bda(x_with_bias, residual, prob)

        return call

    return get
