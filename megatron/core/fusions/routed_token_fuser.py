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
tensor arguments unbacked on every call, so dynamo traces one graph with a symbolic token count
(including 0 and 1) the first time and never guards on the count again. The fused functions are
called inside autograd functions, with grad mode off; there the tensors are also passed detached
(dynamo guards on a view's base and on ``requires_grad``), and a tensor that starts inside its
storage (the probs slice of every expert but the first) as a copy that starts at offset 0
(dynamo specializes storage offsets of 0 and 1 as it does sizes). The copy is of one value per
token.
"""

import functools
import inspect

import torch

from megatron.core import jit


def _mark_unbacked():
    """``torch._dynamo.decorators.mark_unbacked``, or None on a torch without it."""
    try:
        from torch._dynamo.decorators import mark_unbacked
    except ImportError:
        return None
    return mark_unbacked


def _routed(arg, mark_unbacked):
    """``arg`` as the compiled function should see it: dimension 0 unbacked, and the same guards
    on every call.

    Inside an autograd function (grad mode off) ``arg`` is detached (no view base whose size
    dynamo would guard on, and the same ``requires_grad`` whether or not the caller's tensor has
    it) and copied if it starts inside its storage.
    """
    if not isinstance(arg, torch.Tensor) or arg.dim() == 0:
        return arg
    if not torch.is_grad_enabled():
        arg = arg.detach()
        if arg.storage_offset() != 0:
            arg = arg.clone()
    mark_unbacked(arg, 0)
    return arg


def routed_token_fuser(*token_args):
    """Decorator: ``jit_fuser`` with dimension 0 of the arguments named ``token_args`` marked as a
    data-dependent token count.

    Where ``jit_fuser`` is not ``torch.compile`` (older torch: TorchScript; or a no-op) the
    function is decorated by ``jit_fuser`` alone.
    """

    def decorate(fn):
        compiled = jit.jit_fuser(fn)
        mark_unbacked = _mark_unbacked()
        if jit.jit_fuser is not torch.compile or mark_unbacked is None:
            return compiled
        positions = [list(inspect.signature(fn).parameters).index(name) for name in token_args]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not torch.compiler.is_compiling():
                args = [
                    _routed(a, mark_unbacked) if i in positions else a for i, a in enumerate(args)
                ]
                kwargs = {
                    k: _routed(v, mark_unbacked) if k in token_args else v
                    for k, v in kwargs.items()
                }
            return compiled(*args, **kwargs)

        return call

    return decorate
