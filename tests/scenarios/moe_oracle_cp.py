"""Context parallelism (CP) for tests/scenarios/moe_oracle.py.

Upstream's local ``DotProductAttention`` asserts CP == 1 (CP attention is Transformer Engine's,
absent on the CPU ranks). :class:`CPCoreAttention` stands in for it where the case's CP size is
above 1, and only there: it is upstream's ``DotProductAttention`` built from a copy of the config
with ``context_parallel_size = 1``, whose forward all-gathers K and V over the CP group, puts
them back in sequence order and masks by global positions (causal). It is a test stand-in for
TE's ring attention, not what upstream runs. Everything else is upstream's code at the case's CP
size: the load-balanced split of each microbatch (``get_batch_on_this_cp_rank``), RoPE's CP
slicing, the router's reductions over TP x CP (aux, seq aux, global aux and z-loss counts), MTP's
``roll_tensor`` halo exchange between CP ranks, DDP's reduction over DP x CP (its
``gradient_scaling_factor`` of 1 / (DP x CP) under the mean loss), the schedule's loss and aux
scales and ``finalize_model_grads`` (token counts over DP x CP, expert-bias counts over
TP x DP x CP).

Layout of a CP rank (upstream's load-balanced split, the same on 0.18.2, 0.19.2 and dev): the
sequence is cut into ``2 * CP`` chunks; CP rank ``r`` holds chunks ``r`` and ``2 * CP - 1 - r``,
in that order.
"""

import copy

import torch


def positions(rank, cp, seq):
    """The global sequence positions CP rank ``rank`` holds, in its local order."""
    chunk = seq // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def owner(cp, seq):
    """[seq]: the CP rank holding each global position."""
    out = torch.empty(seq, dtype=torch.long)
    for rank in range(cp):
        out[positions(rank, cp, seq)] = rank
    return out


def split(batch, cp_group):
    """This CP rank's part of ``batch`` ({name: [b, s] tensor}), by upstream's own function."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: the sum of every rank's gradient of
    the gathered tensor (all-reduce), this rank's slice (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        size = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        size = torch.distributed.get_world_size(ctx.group)
        rank = torch.distributed.get_rank(ctx.group)
        return grad.chunk(size, dim=0)[rank], None


def _core_attention_class():
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CPCoreAttention(DotProductAttention):
        """Upstream's DotProductAttention over the whole sequence of keys and values of the CP
        group (a test stand-in for CP attention; see the module docstring)."""

        def __init__(self, config, *args, **kwargs):
            local = copy.copy(config)
            local.context_parallel_size = 1
            super().__init__(local, *args, **kwargs)
            self.cp_group = ps.get_context_parallel_group()
            self.cp = ps.get_context_parallel_world_size()
            self.cp_rank = ps.get_context_parallel_rank()

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            assert attention_mask is None, 'CPCoreAttention: causal only'
            seq = key.size(0) * self.cp
            rows = torch.cat([positions(r, self.cp, seq) for r in range(self.cp)])
            order = torch.argsort(rows)
            key = _GatherSequence.apply(key, self.cp_group).index_select(0, order)
            value = _GatherSequence.apply(value, self.cp_group).index_select(0, order)
            local = positions(self.cp_rank, self.cp, seq)
            # True = masked (upstream's attention_mask_func): keys after the query's position.
            mask = (torch.arange(seq)[None, :] > local[:, None])[None, None]
            # Upstream's softmax builds its causal mask only where none is given (sq == sk).
            return super().forward(query, key, value, mask, *args, **kwargs)

    return CPCoreAttention


def layer_spec(spec):
    """A copy of the local layer spec whose core attention is :class:`CPCoreAttention`."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = _core_attention_class()
    return spec
