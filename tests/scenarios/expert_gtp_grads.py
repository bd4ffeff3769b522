"""Scenario: expert grads under generalized tensor parallelism (GTP) when EP = 1, ETP = TP and
expert GTP != dense GTP (upstream PR 6080).

Real upstream code: ``initialize_model_parallel`` with ``gtp_remat_size`` /
``expert_gtp_remat_size``, the local ``ColumnParallelLinear`` / ``RowParallelLinear`` built with
``is_expert=True`` (their weights are sliced into ``GTPShardedParam`` shards by
``wrap_module_params_gtp``), ``DistributedDataParallel`` and ``finalize_model_grads``.

What does not run on CPU: GTP's weight all-gather and wgrad reduce-scatter (forward and backward of
a GTP-sharded layer) call TransformerEngine's ``gather_along_first_dim`` /
``reduce_scatter_along_first_dim``; without TE (CUDA-only) upstream stubs them with MagicMock.
So the scenario writes what that backward leaves in each ``main_grad`` (the reduce-scatter output
for a sharded weight, the local grad for a replicated bias): ``2 ** rank``, distinct per rank set,
as upstream's own test does; then the real DP sync (``finalize_model_grads``) runs.

Expected values never come from megatron's groups: the full weights are initialised with
``arange`` so every shard's content says which logical rows/columns it holds; the replicas of a
shard are the ranks whose shard has identical content. With per-token loss (no DDP pre-scaling;
the GTP axes are summed, as upstream documents), a correctly synced grad equals the sum of
``2 ** q`` over the ranks q holding the same shard.
"""

import torch

from tests.scenarios.common import stats_config

HIDDEN, FFN = 4, 8


def _gtp_config(tp, etp, gtp, egtp, per_token):
    """Initialise (TP, EP = 1, ETP, GTP, EGTP) and return the fp32 config of the expert layers."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=etp,
        gtp_remat_size=gtp,
        expert_gtp_remat_size=egtp,
    )
    return stats_config(
        'fp32',
        tp=tp,
        etp=etp,
        tensor_parallel_num_weight_shards=tp * gtp,
        expert_tensor_parallel_num_weight_shards=etp * egtp,
        calculate_per_token_loss=per_token,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
    )


def _gtp_experts(cfg, bias, average_in_collective=False):
    """Expert fc1/fc2 with ``arange`` weights, wrapped in DDP (by default no averaging in the
    collective: DDP pre-scales under the mean loss)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    def arange_init(weight):  # every logical element distinct
        with torch.no_grad():
            weight.copy_(torch.arange(weight.numel()).reshape(weight.shape))

    class _Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            common = dict(config=cfg, init_method=arange_init, is_expert=True, bias=bias)
            self.fc1 = ColumnParallelLinear(
                HIDDEN, FFN, gather_output=False, skip_bias_add=True, **common
            )
            self.fc2 = RowParallelLinear(
                FFN, HIDDEN, input_is_parallel=True, skip_bias_add=True, **common
            )

    module = _Experts()
    return DistributedDataParallel(
        cfg,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            average_in_collective=average_in_collective,
        ),
        module,
    )


def _replicas(params, names, etp):
    """Per param, the ranks holding the same logical piece, found from the contents.

    A weight is known by its values, a bias (zero-initialised) by the ETP block of fc1's rows on
    that rank.
    """
    import torch.distributed as dist

    world = dist.get_world_size()

    def gathered(t):
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous())
        return out

    def fc1_etp_block(w):  # fc1 full weight is arange(FFN * HIDDEN).reshape(FFN, HIDDEN)
        return int(w.flatten()[0].float()) // HIDDEN // (FFN // etp)

    keys = {}
    for n in names:
        if n.endswith('weight'):
            keys[n] = params[n].detach().float().flatten()
        else:
            # Expert DP and expert GTP reduce a bias; ETP peers keep their own (they see the
            # same tokens): its replicas are the ranks in the same ETP block.
            keys[n] = torch.tensor([float(fc1_etp_block(params['fc1.weight'].detach()))])
    replicas = {}
    for n in names:
        # Shards of different sizes cannot be gathered together: pad to a common length.
        k = keys[n]
        longest = int(max(s.item() for s in gathered(torch.tensor([k.numel()]))))
        padded = torch.full((longest + 1,), -1.0)  # contents are >= 0
        padded[0] = k.numel()
        padded[1 : 1 + k.numel()] = k
        every = gathered(padded)
        replicas[n] = [q for q in range(world) if torch.equal(every[q], padded)]
    return replicas


def _report(cfg, params, names, expert_buffer, replicas, synced, correct):
    """The per-rank result: flags, buffers, shapes, grads against the correct ones, DP groups."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    edp = ps.get_expert_data_parallel_group(with_gtp_remat=False)
    dp = ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=False)
    return {
        'allreduce': {n: getattr(params[n], 'allreduce', None) for n in names},
        'buffer': {n: 'expert' if id(params[n]) in expert_buffer else 'dense' for n in names},
        'gtp_sharded': {n: bool(getattr(params[n], 'is_gtp_weight_remat', False)) for n in names},
        'shapes': {n: list(params[n].shape) for n in names},
        'replicas': replicas,
        'grad_after_sync': synced,
        'correct_grad_after_sync': correct,
        'expert_dp_ranks': dist.get_process_group_ranks(edp),
        'dense_dp_ranks': dist.get_process_group_ranks(dp),
        'config_egtp': cfg.expert_gtp_weight_remat_size,
        'config_gtp': cfg.gtp_weight_remat_size,
        'data_shards': dist.get_world_size(
            ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=True)
        ),
    }


def scenario_expert_gtp_sync(
    ctx, tp, etp, gtp, egtp, bias=True, per_token=True, average_in_collective=False
):
    """Build expert fc1/fc2 under (TP, ETP, GTP, EGTP) with EP = 1, DDP-wrap them, sync grads.

    ``per_token=False`` runs the mean loss instead (DDP pre-scales every grad; issue 31's
    candidate 7, tests/test_moe_candidates.py); ``average_in_collective=True`` with it averages in
    the DP collective instead of pre-scaling (upstream's DDP refuses it where (expert) GTP > 1).

    Returns per rank: the ``allreduce`` flag and DDP buffer ('dense'/'expert') of every param,
    whether its weight is GTP-sharded, its grad after ``finalize_model_grads`` and the correct
    grad computed from the shard contents, the replica ranks, and the sizes of the DP groups.
    """
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import (
        GTP_CONFIG,
        reset_gtp_state,
        update_gtp_config,
    )

    # Shards of exactly 1/EGTP of the rows (no alignment padding), so their contents are distinct.
    pad = GTP_CONFIG.pad_for_alignment
    update_gtp_config(pad_for_alignment=0)
    try:
        cfg = _gtp_config(tp, etp, gtp, egtp, per_token)
        model = _gtp_experts(cfg, bias, average_in_collective)
        params = dict(model.module.named_parameters())
        names = sorted(params)
        expert_buffer = {id(p) for b in model.expert_parallel_buffers for p in b.params}
        replicas = _replicas(params, names, etp)

        # What the GTP backward (weights) or the local backward (biases) leaves in main_grad.
        for n in names:
            params[n].main_grad.fill_(float(2**ctx.rank))
        finalize_model_grads([model])
        synced = {n: sorted({float(v) for v in params[n].main_grad.flatten()}) for n in names}
        correct = {n: float(sum(2**q for q in replicas[n])) for n in names}
        return _report(cfg, params, names, expert_buffer, replicas, synced, correct)
    finally:
        update_gtp_config(pad_for_alignment=pad)
        reset_gtp_state()


def scenario_expert_gtp_sync_layouts(ctx, layout_list):
    """``scenario_expert_gtp_sync`` over several (tp, etp, gtp, egtp) layouts in one world.

    Returns:
        {'cases': [per layout: whether every grad after finalize_model_grads equals the sum over
        its replicas on this rank, the DDP buffer kinds of the expert params, and whether this
        rank's dense and expert DP groups (the ones DDP reduces its buffers over) differ]}.
    """
    from megatron.core import parallel_state as ps

    cases = []
    for tp, etp, gtp, egtp in layout_list:
        try:
            res = scenario_expert_gtp_sync(ctx, tp, etp, gtp, egtp)
        finally:
            ps.destroy_model_parallel()
        cases.append(
            {
                'layout': [tp, etp, gtp, egtp],
                'buffer': sorted(set(res['buffer'].values())),
                'groups_differ': res['dense_dp_ranks'] != res['expert_dp_ranks'],
                'grads_ok': all(
                    res['grad_after_sync'][n] == [res['correct_grad_after_sync'][n]]
                    for n in res['grad_after_sync']
                ),
            }
        )
    return {'cases': cases}


def layouts(world_size):
    """Every (tp, etp, gtp, egtp) with EP = PP = CP = 1 whose dense and expert grids fit."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    pairs = [(a, b) for a in divisors for b in divisors if world_size % (a * b) == 0]
    return [(tp, etp, gtp, egtp) for tp, gtp in pairs for etp, egtp in pairs]
