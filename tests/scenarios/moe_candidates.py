"""Issue 31 (MoE gradients), candidates 1-6 and 8: the router, metrics, MoE layer and MTP.

Router cases (candidates 1-3) run upstream's ``TopKRouter`` wrapped in megatron DDP: one forward
on this rank's share of a seeded global batch [SEQ, BATCH, HIDDEN] (a sequence chunk per TP rank,
sequence parallel whenever TP > 1), a main loss of zero (``0 * probs.sum()``) so that only the
auxiliary losses reach the router weight, the aux-loss scale the schedule sets
(``MoEAuxLossAutoScaler.set_loss_scale``: 1 under per-token loss, 1 / num_microbatches else), and
the real ``finalize_model_grads`` with the loss function's token count (the replica's valid
tokens) under ``calculate_per_token_loss``.

The reference is the same router in float64 in one process (TP 1, each rank alone) over the whole
global batch with the mean loss (no per-token rescale): the gradient of the auxiliary objective
itself, which is what upstream defines as the target of the per-token path (a final scaling of the
aux gradients of 1 / (num_microbatches * dp_size)). The float32 copy of that one-process run gives
the bound: the test allows a few times its distance from float64.

Expert-bias counts (candidate 4): ``local_tokens_per_expert`` after one forward with a padding
mask, against the same router fed only the valid tokens (no mask): top-k routing is per token.
"""

import datetime
import types

import torch

HIDDEN = 8
EXPERTS = 4
TOPK = 2
SEED = 31031
COEFF = {'aux_loss': 1e-1, 'seq_aux_loss': 1e-1, 'global_aux_loss': 1e-1, 'z': 1e-2}


def _router_config(tp, loss, per_token, dtype, bias=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if loss == 'z':
        extra['moe_router_load_balancing_type'] = 'none'
        extra['moe_z_loss_coeff'] = COEFF['z']
    elif loss == 'none':
        extra['moe_router_load_balancing_type'] = 'none'
    else:
        extra['moe_router_load_balancing_type'] = loss
        extra['moe_aux_loss_coeff'] = COEFF[loss]
    if bias:
        extra.update(moe_router_enable_expert_bias=True, moe_router_score_function='sigmoid')
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_router_dtype='fp64' if dtype == torch.float64 else 'fp32',
        calculate_per_token_loss=per_token,
        add_bias_linear=False,
        use_cpu_initialization=True,
        **extra,
    )


def _global_batch(seq, bsz, pad):
    """x [seq, bsz, HIDDEN] and the padding mask [seq, bsz] (True = padding): padding at the end
    of sequence 0 and one token inside sequence 1, so the TP chunks hold different counts."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(seq, bsz, HIDDEN, generator=gen, dtype=torch.float64)
    mask = torch.zeros(seq, bsz, dtype=torch.bool)
    if pad:
        mask[seq - seq // 4 :, 0] = True
        mask[1, bsz - 1] = True
    return x, mask


def _router_weight():
    gen = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(EXPERTS, HIDDEN, generator=gen, dtype=torch.float64) * 0.5


class _RouterModule(torch.nn.Module):
    def __init__(self, config, alone=False):
        from megatron.core.transformer.moe.router import TopKRouter

        super().__init__()
        kwargs = _pg_kwargs()
        if alone:
            # The one-process reference inside a larger world (TP 1, so DP = world): its
            # TP x DP x CP domain (global aux loss) is this rank alone.
            kwargs['pg_collection'].tp_dp_cp = _own_group()
        self.router = TopKRouter(config=config, **kwargs)

    def forward(self, x, padding_mask):
        kwargs = {} if padding_mask is None else {'padding_mask': padding_mask}
        return self.router(x, **kwargs)


def _own_group():
    """A process group of this rank alone (every rank creates every rank's)."""
    world = torch.distributed.get_world_size()
    groups = [torch.distributed.new_group([r]) for r in range(world)]
    return groups[torch.distributed.get_rank()]


def _pg_kwargs():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return {'pg_collection': ProcessGroupCollection.use_mpu_process_groups()}


def _router_run(ctx, case, dtype, reference):
    """One router forward/backward and finalize; returns the router weight's final grad."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    tp = 1 if reference else case['tp']
    per_token = False if reference else case['per_token']
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    # The scale is class state that outlives the call: leave it as found (a later pretrain() in
    # this process copies a shape-[1] scale into it).
    saved_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        config = _router_config(tp, case['loss'], per_token, dtype)
        module = _RouterModule(config, alone=reference)
        with torch.no_grad():
            module.router.weight.copy_(_router_weight().to(dtype))
        model = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64),
            module,
        )
        batches = [_global_batch(case['seq'], case['bsz'], bool(case['pad']))]
        if case['pad'] == 'all':
            # A second microbatch of padding only: no TP x CP rank holds a valid token.
            gen = torch.Generator().manual_seed(SEED + 3)
            x = torch.randn(batches[0][0].shape, generator=gen, dtype=torch.float64)
            batches.append((x, torch.ones_like(batches[0][1])))
            module.router.set_layer_number(1)  # the z-loss is logged for a numbered layer only
        rank = ps.get_tensor_model_parallel_rank()
        chunk = case['seq'] // tp
        # The schedule's scale: 1 under per-token loss, 1 / num_microbatches else.
        scale = 1.0 if per_token else 1.0 / len(batches)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=dtype))
        logged = []
        for x, mask in batches:
            x_local = x[rank * chunk : (rank + 1) * chunk].to(dtype).contiguous()
            mask_local = mask[rank * chunk : (rank + 1) * chunk].contiguous()
            probs, _ = model(x_local, mask_local if case['pad'] else None)
            (probs * 0).sum().backward()
            if case['pad'] == 'all':
                logged.append(_pop_logged_z_loss())
        # The loss function's count: the replica's valid tokens (the whole sequence, every TP
        # rank, every microbatch); finalize_model_grads sums it over DP x CP and divides every
        # grad by it.
        valid = sum(int((~mask).sum()) for _, mask in batches)
        num_tokens = torch.tensor(valid, dtype=torch.int) if per_token else None
        finalize_model_grads([model], num_tokens=num_tokens)
        grad = module.router.weight.main_grad.detach().double().clone()
        return grad, logged
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved_scale
        ps.destroy_model_parallel()


def _pop_logged_z_loss():
    """The z-loss the router recorded in the MoE metrics tracker (layer 1), then emptied."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    metrics = get_moe_metrics_tracker().metrics
    value = float(metrics['z_loss'].values[0])
    metrics.clear()
    return value


def scenario_router_grads(ctx, cases, reference=False):
    """Per case, the router weight's grad after finalize_model_grads (flat list).

    Args:
        cases: dicts with 'name', 'tp', 'loss' ('aux_loss', 'seq_aux_loss', 'global_aux_loss',
            'z'), 'per_token', 'pad', 'seq', 'bsz'. 'pad': False, True (the mask of
            _global_batch) or 'all': that padded microbatch, then one of padding only (two
            microbatches of one step); its result also has 'logged': the z-loss the router
            recorded per microbatch (a 'z' case).
        reference: run each case at TP 1 over the whole batch with the mean loss, in float64 and
            float32, each rank alone (its DP replicas compute the same grads): 'ref64', 'ref32'.
    """
    out = []
    for case in cases:
        res = {'name': case['name']}
        try:
            if reference:
                res['ref64'] = _router_run(ctx, case, torch.float64, True)[0].flatten().tolist()
                res['ref32'] = _router_run(ctx, case, torch.float32, True)[0].flatten().tolist()
            else:
                grad, logged = _router_run(ctx, case, torch.float32, False)
                res['grad'] = grad.flatten().tolist()
                if logged:
                    res['logged'] = logged
        except Exception as exc:  # noqa: BLE001 - upstream's error is the result
            res['error'] = f'{type(exc).__name__}: {exc}'
        out.append(res)
    return {'cases': out}


def scenario_expert_bias_counts(ctx, cases):
    """Per case (seq, bsz), ``local_tokens_per_expert`` after a forward with padding, and the
    counts of the same router over the valid tokens only (TP 1, every rank alone)."""
    from megatron.core import parallel_state as ps

    out = []
    for case in cases:
        res = {'name': case['name']}
        ps.initialize_model_parallel()
        try:
            config = _router_config(1, 'none', False, torch.float32, bias=True)
            module = _RouterModule(config)
            with torch.no_grad():
                module.router.weight.copy_(_router_weight().float())
            module.train()
            x, mask = _global_batch(case['seq'], case['bsz'], True)
            valid = x[~mask].unsqueeze(1).float()  # [valid tokens, 1, HIDDEN]
            module(valid, None)
            res['want'] = module.router.local_tokens_per_expert.tolist()
            module.router.local_tokens_per_expert.zero_()
            try:
                # Eager: the harness's CUDA-on-CPU redirect cannot run under torch.compile (the
                # router's jit_fuser), which fails dev's correct code on CPU.
                with torch._dynamo.config.patch(disable=True):
                    module(x.float(), mask)
                res['got'] = module.router.local_tokens_per_expert.tolist()
            except Exception as exc:  # noqa: BLE001
                res['error'] = f'{type(exc).__name__}: {exc}'
        finally:
            ps.destroy_model_parallel()
        out.append(res)
    return {'cases': out}


# (number of layers, per pipeline stage the (name, layer number, value) its routers record): PP 2
# with the MoE layer on stage 0 only (the default), and PP 4 with MoE layers on the last two
# stages only: stage 2 records two names, z_loss first, stage 3 one of them (the stages' own
# orders differ, and the last stage lacks a name). tests/test_moe_candidates.py reads it.
METRICS_PP_RECORDS = {
    'pp2': (2, [[('load_balancing_loss', 1, 0.25)], []]),
    'pp4-late': (
        4,
        [
            [],
            [],
            [('z_loss', 3, 0.5), ('load_balancing_loss', 3, 0.25)],
            [('load_balancing_loss', 4, 0.125)],
        ],
    ),
}


class _Scalars:
    """Stands in for TensorBoard's ``SummaryWriter``: the values ``report`` writes, unrounded."""

    def __init__(self):
        self.values = {}

    def add_scalar(self, name, value, iteration):
        self.values[name] = float(value)


def scenario_metrics_pp(ctx, force_initialize=False, timeout_s=5, layout='pp2'):
    """PP = world size: each stage records what ``METRICS_PP_RECORDS[layout]`` gives it (a stage
    without MoE layers records nothing); every rank then calls the tracker's ``report`` as a
    library user would (no force_initialize), with a gloo PP group whose timeout is
    ``timeout_s``, so a one-sided all-reduce fails instead of hanging. ``force_initialize``: as
    Megatron's training loop calls it, every recorded name tracked. Returns each rank's
    'report_error' (or None), log string and the scalars written (unrounded)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from tests.harness.group_cache import uncached_new_group

    num_layers, records = METRICS_PP_RECORDS[layout]
    ps.initialize_model_parallel(pipeline_model_parallel_size=len(records))
    try:
        pp_ranks = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        pp_group = uncached_new_group(
            pp_ranks, backend='gloo', timeout=datetime.timedelta(seconds=timeout_s)
        )
        pgc = types.SimpleNamespace(
            pp=pp_group, dp=ps.get_data_parallel_group(), dp_cp_gtp_remat=None
        )
        tracker = get_moe_metrics_tracker()
        tracker.metrics.clear()
        stage = ps.get_pipeline_model_parallel_rank()
        for name, layer, value in records[stage]:
            tracker.record(name, torch.tensor(value), layer, num_layers)
        writer = _Scalars()
        kwargs = dict(
            loss_scale=1.0, iteration=1, writer=writer, num_layers=num_layers, pg_collection=pgc
        )
        if force_initialize:
            names = sorted({name for recs in records for name, _, _ in recs})
            kwargs.update(force_initialize=True, track_names=names)
        try:
            log = tracker.report(**kwargs)
            return {'stage': stage, 'report_error': None, 'log': log, 'scalars': writer.values}
        except Exception as exc:  # noqa: BLE001
            return {
                'stage': stage,
                'report_error': f'{type(exc).__name__}: {exc}'[:300],
                'log': None,
                'scalars': writer.values,
            }
        finally:
            tracker.metrics.clear()
    finally:
        ps.destroy_model_parallel()


def _moe_config(dtype, tp):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=HIDDEN,
        num_attention_heads=4,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_router_dtype='fp64' if dtype == torch.float64 else 'fp32',
        moe_router_load_balancing_type='none',
        moe_token_dispatcher_type='allgather',
        add_bias_linear=True,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )


def _moe_grads(dtype, tp, seq, bsz, hand=False):
    """Upstream's MoELayer (local spec, biases on) at (tp, EP 1, ETP 1): this rank's grads of
    sum(output * probe) over its sequence chunk, params set from their names; with ``hand``, also
    those of :func:`_hand_moe` (no megatron code) in want['hand'] and want['hand_bias_term']."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        config = _moe_config(dtype, tp)
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
        layer = spec.submodules.mlp(config=config)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                digest = sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**31
                gen = torch.Generator().manual_seed(SEED + digest)
                p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5).to(dtype))
        gen = torch.Generator().manual_seed(SEED + 2)
        x = torch.randn(seq, bsz, HIDDEN, generator=gen, dtype=torch.float64)
        probe = torch.randn(seq, bsz, HIDDEN, generator=gen, dtype=torch.float64)
        rank, chunk = ps.get_tensor_model_parallel_rank(), seq // tp
        sl = slice(rank * chunk, (rank + 1) * chunk)
        routed = []
        layer.router.register_forward_hook(lambda mod, args, out: routed.append(out))
        out, out_bias = layer(x[sl].to(dtype).contiguous())
        if out_bias is not None:
            out = out + out_bias
        (out.double() * probe[sl]).sum().backward()
        grads = {
            n: p.grad.detach().double().flatten().tolist() for n, p in layer.named_parameters()
        }
        # The expert fc2 bias enters each routed token's output times its routing probability:
        # d loss / d bias_e = sum over tokens of probs[t, e] * probe[t] (from the router alone).
        probs = routed[0][0].detach().double()  # [tokens, experts], zero where not routed
        flat_probe = probe[sl].reshape(-1, HIDDEN)
        want = {
            f'experts.local_experts.{e}.linear_fc2.bias': (probs[:, e : e + 1] * flat_probe)
            .sum(0)
            .tolist()
            for e in range(EXPERTS)
        }
        if hand:
            params = {n: p.detach().double() for n, p in layer.named_parameters()}
            want['hand'] = _hand_moe(params, x[sl], probe[sl], bias_term=False)
            want['hand_bias_term'] = _hand_moe(params, x[sl], probe[sl], bias_term=True)
        return grads, want
    finally:
        ps.destroy_model_parallel()


def _hand_moe(params, x, probe, bias_term):
    """The MoE layer of _moe_config written out in float64 (router logits x W^T + b, top-k, a
    softmax over the top-k logits; each expert fc2(gelu(fc1(x))) plus its fc2 bias, times the
    token's probability), autograd over a copy of ``params``: {name: grad of sum(out * probe)}
    as flat lists. With ``bias_term``, the loss is the fc2 bias term alone
    (sum over tokens and experts of probs[t, e] * (bias_e . probe[t])): its router grads are the
    share that reaches the router only through the fc2 biases."""
    import torch.nn.functional as F

    leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ leaves['router.weight'].T + leaves['router.bias']
    top, index = logits.topk(TOPK, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, index, torch.softmax(top, dim=-1))
    out = torch.zeros_like(tokens)
    for e in range(EXPERTS):
        names = ('fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias')
        expert = {k: leaves[f'experts.local_experts.{e}.linear_{k}'] for k in names}
        term = expert['fc2.bias'].expand_as(tokens)
        if not bias_term:
            hidden = F.gelu(tokens @ expert['fc1.weight'].T + expert['fc1.bias'])
            term = term + hidden @ expert['fc2.weight'].T
        out = out + probs[:, e : e + 1] * term
    (out * probe.reshape(-1, HIDDEN)).sum().backward()
    return {n: p.grad.flatten().tolist() for n, p in leaves.items() if p.grad is not None}


def scenario_moe_bias_grads(ctx, seq=4, bsz=2):
    """Candidate 6: the MoE layer with biases at EP = ETP = 1 (TP = world), float32 and, in the same
    process, float64. Returns 'grads' (or 'train_error'), 'ref64' (or 'ref_error'), 'bias_want':
    the expert fc2 bias grads from the router's probabilities (float64), and 'hand' /
    'hand_bias_term': the float64 layer written out without megatron (_hand_moe)."""
    res = {}
    for key, dtype in (('grads', torch.float32), ('ref64', torch.float64)):
        try:
            res[key], want = _moe_grads(dtype, 1, seq, bsz, hand=dtype == torch.float64)
            if dtype == torch.float64:
                res['hand'] = want.pop('hand')
                res['hand_bias_term'] = want.pop('hand_bias_term')
                res['bias_want'] = want
        except Exception as exc:  # noqa: BLE001
            res[key.replace('grads', 'train_error').replace('ref64', 'ref_error')] = (
                f'{type(exc).__name__}: {exc}'[:400]
            )
    return res


def scenario_mtp_microbatches(ctx, depth=1, seed=1, num_microbatches=2):
    """Candidate 8: MTP under per-token loss with uneven valid tokens over gradient-accumulation
    microbatches (each rank alone: DP and CP 1, ``num_microbatches`` microbatches of one step).

    The model, the data and the float64 references are tests/scenarios/mtp_per_token_loss.py's,
    with the microbatches in place of the DP ranks there: 'reference' is the objective of
    per-token loss over the whole step with the MTP term a mean over its tokens (MTP tokens
    weighted 1 / M with M summed over the microbatches), 'per_microbatch' the same with each
    microbatch's MTP loss rescaled by its own N / M (pristine's rescale at forward time), and
    'tokens' the fork's objective since 0043 (every MTP token weighted scale / N, N the step's
    main-loss token count, as a main token is weighted 1 / N).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from tests.scenarios import mtp_per_token_loss as mtp

    ps.initialize_model_parallel()
    world = torch.distributed.get_world_size()
    try:
        MTPLossLoggingHelper.tracker = {}
        _, params, module, model = mtp._ddp_model(ctx, depth, seed)
        masks = mtp._masks(num_microbatches, True)
        data = [mtp._batch(seed, i) for i in range(num_microbatches)]
        batches = [(tok, lab, m) for (tok, lab), m in zip(data, masks)]
        mtp._step(model, batches, num_microbatches)
        # Every DP rank ran the same microbatches: the grads and the token count summed over DP
        # give the same quotient as one rank alone.
        got = mtp._main_grads(module)
        return {
            'grads': got,
            'reference': mtp._reference(params, data, masks, depth, 'global'),
            'per_microbatch': mtp._reference(params, data, masks, depth, 'local'),
            'tokens': mtp._reference(params, data, masks, depth, 'tokens'),
            'dp_size': ps.get_data_parallel_world_size(),
            'world': world,
            'counts': [[float(m.sum()), float(mtp._rolled(m.clone(), 1).sum())] for m in masks],
        }
    finally:
        ps.destroy_model_parallel()
