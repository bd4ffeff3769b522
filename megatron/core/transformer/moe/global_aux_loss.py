# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The global load-balancing loss as its definition states it, at any DP size and over any
number of microbatches.

``global_aux_loss`` is the Switch/GShard loss ``E * sum_i f_i * P_i`` with the expert fractions
``f_i`` taken over the global batch: every TP x DP x CP rank's tokens, and the step's
microbatches so far. Each rank holds ``P_i`` of its own tokens only, over the global token
count, so the global loss is the *sum* of the ranks' losses. Two things kept the router's
gradient off that definition:

- the running per-expert counts were averaged over the microbatches and divided by the current
  microbatch's token count: ``f`` was off by the ratio of the mean count so far to the current
  one whenever microbatches hold different numbers of valid tokens (padding, packing);
  :func:`running_tokens_per_expert` rescales the counts so that ``f`` is the step's counts over
  the step's tokens;
- DDP averages the ranks' gradients over DP where the loss is their sum: 1 / DP of the loss's
  gradient under the mean loss (:func:`scale_to_global_loss`), and, under per-token loss, the
  share was rescaled by the rank's own token count instead of the count the global loss averages
  over (:func:`per_token_count_share`).
"""

import torch


def running_tokens_per_expert(router, num_tokens):
    """Per-expert counts to pass with ``num_tokens`` (this microbatch's global token count) to
    ``switch_load_balancing_loss_func``: the step's running counts rescaled from the step's
    running token count to ``num_tokens``, so that ``f_i`` = running count / running tokens.

    Call after ``router.global_tokens_per_expert`` and ``router.ga_steps`` took this
    microbatch in; the running token count starts over when ``ga_steps`` does (its reset), with
    no host synchronization.
    """
    counts = router.global_tokens_per_expert
    num_tokens = torch.as_tensor(num_tokens, dtype=counts.dtype, device=counts.device)
    running = getattr(router, 'global_aux_num_tokens', None)
    if running is None:
        running = num_tokens.clone()
    else:
        running = torch.where(router.ga_steps > 1, running + num_tokens, num_tokens)
    router.global_aux_num_tokens = running
    return counts * (num_tokens / running.clamp(min=1))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward (the logged value is the loss's own); the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, loss, scale):
        """The loss unchanged."""
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        """The loss's gradient times the scale."""
        return grad * ctx.scale, None


def scale_to_global_loss(router, aux_loss):
    """Under the mean loss, ``aux_loss`` (this rank's share of the global loss) with its gradient
    multiplied by the DP size, which DDP's mean over DP divides it by. Per-token loss sums over
    DP and is left as it is."""
    dp_size = router.tp_dp_cp_group.size() // router.tp_cp_group.size()
    if router.calculate_per_token_loss or dp_size == 1:
        return aux_loss
    return _ScaleGrad.apply(aux_loss, dp_size)


def per_token_count_share(router, num_tokens):
    """Under per-token loss, each TP x CP rank's share of ``num_tokens`` (the global loss's token
    count), which the per-token rescale of the load-balancing losses sums over TP x CP: the
    global loss is weighted by the tokens it averages over, as every token of the main loss
    weighs 1 / (the step's token count)."""
    if torch.is_tensor(num_tokens):
        return num_tokens / router.tp_cp_group.size()
    return num_tokens // router.tp_cp_group.size()
