"""Issue 31's MoE gradient oracle: a small MoE GPT in every parallel layout against one process.

The model is upstream's ``GPTModel`` with the local layer spec (``get_gpt_layer_local_spec`` with
``num_experts``, no grouped GEMM): 2 layers, each an MoE layer of 4 local SwiGLU experts (top-2),
a shared expert, no linear bias, dropout 0, float32 params; the router has an expert bias
(sigmoid scores), a z-loss and the case's load-balancing losses; MTP depth 1 where the case
asks for it. :func:`scenario_parallel` runs it through the real schedule
(``get_forward_backward_func()``, 2 microbatches with uneven valid tokens), megatron DDP (the
distributed optimizer on or off) and ``finalize_model_grads`` (the schedule's own call), then
all-gathers each bucket's reduce-scattered shard (distributed optimizer) and returns every
parameter's gradient under its global key and offset (``sharded_state_dict()`` built on the
gradients) and the expert-bias update with the tokens per expert it used.

:func:`scenario_reference` (a world of one rank) computes the same model and global batch at
TP = EP = PP = CP = 1 with plain autograd, float64 (and float32, for the bound), microbatch by
microbatch, with the weights of each term set by :func:`objective_weights` (main loss, aux
losses) and :func:`mtp_weight` (the MTP term) instead of upstream's per-token rescales. The
global aux loss is not upstream's there: :class:`_GlobalAux` writes it out from its definition
(tests/scenarios/global_aux_loss.py), microbatch m of every DP rank forward before any of them
backward. Every weight is set from the global key of the parameter (:func:`_init_value`), so
both runs start from the same numbers.
"""

import contextlib
import hashlib

import torch

from tests.scenarios import common, moe_oracle_cp

HIDDEN = 16
HEADS = 4
FFN = 32
MOE_FFN = 16
SHARED_FFN = 16
EXPERTS = 4
TOPK = 2
VOCAB = 64
SEQ = 8
MBS = 2
NUM_MICROBATCHES = 2
LAYERS = 2  # unless a case sets 'layers' (its virtual pipeline chunks: one layer each)
SEED = 31310
AUX_COEFF = {'aux_loss': 1e-1, 'seq_aux_loss': 2e-1, 'global_aux_loss': 3e-1}
Z_COEFF = 1e-2
MTP_SCALE = 0.3
BIAS_RATE = 1e-2


# ------------------------------------------------------------------------------------------
# The objective (one place: the test's oracle is defined here).


def objective_weights(
    per_token, main_count, router_count, step_count, dp, microbatches, cp=1, cp_counts=None
):
    """Weights of one microbatch's terms in the step's objective (the one-process reference).

    Args:
        per_token: ``calculate_per_token_loss``.
        main_count: the microbatch's valid tokens (its loss mask).
        router_count: the tokens the microbatch's routers count (its valid tokens with a padding
            mask, all its tokens without).
        step_count: the step's valid tokens (all microbatches, all DP ranks).
        dp, microbatches: the data-parallel size and the number of microbatches.
        cp, cp_counts: the context-parallel size and, where it is above 1, a [MBS, SEQ] tensor:
            per token, the valid tokens of the CP rank that holds it in this microbatch.

    Returns:
        (weight of the microbatch's summed token loss, per token where ``cp_counts`` is given;
        weight of its aux losses and z-loss as upstream's router computes them at TP 1 under
        the mean loss).

    Mean loss under CP: each CP rank's loss_func returns its own (sum, valid tokens); the
    schedule's forward_step_calc_loss divides by its count and the microbatches (0.18.2, 0.19.2
    and dev alike), DDP scales by 1 / (DP x CP) and sums over DP x CP: the mean over microbatches,
    DP and CP ranks of each rank's own masked mean. The aux losses keep 1 / (DP x microbatches):
    the schedule multiplies their scale by CP, which DDP's 1 / (DP x CP) takes back, and each
    CP rank's router term is its part of the whole sequence's loss (counts reduced over TP x CP).
    """
    if per_token:
        # Per-token: every valid token weighs 1 / step_count; an aux loss covers its router's
        # tokens (upstream rescales it by that count before finalize divides by the step's).
        return 1.0 / step_count, router_count / step_count
    # Mean loss: mean over microbatches and DP (and CP ranks) of each microbatch's mean.
    if cp_counts is not None:
        return 1.0 / (cp_counts * cp * dp * microbatches), 1.0 / (dp * microbatches)
    return 1.0 / (main_count * dp * microbatches), 1.0 / (dp * microbatches)


def mtp_weight(per_token, mtp_count, mtp_step_count, step_count, dp, microbatches):
    """Weight of one microbatch's MTP term, ``MTP_SCALE / depth * sum(masked MTP token losses)
    / mtp_count`` (what upstream's ``process_mtp_loss`` attaches under the mean loss).

    Mean loss: the mean over microbatches and DP, as the main loss. Per-token: the objective of
    change 0043 ``mtp-per-token-loss-microbatch-counts`` (candidate 8): every MTP token weighs
    1 / (the step's main-loss tokens, ``step_count``, summed over microbatches and DP), as a
    main-loss token does. ``mtp_step_count`` (the step's MTP tokens) is the per-token mean that
    no single pass can reach; pristine's per-microbatch ratio matches neither.
    """
    if per_token:
        return mtp_count / step_count
    return 1.0 / (dp * microbatches)


# ------------------------------------------------------------------------------------------
# Data.


def microbatch(index):
    """Global microbatch ``index`` (dp_rank * NUM_MICROBATCHES + m): tokens, labels, loss mask
    ([MBS, SEQ]). Sequence 0 loses its last ``index + 1`` tokens and sequence 1 its token 2 when
    ``index`` is odd, so every microbatch holds a different count of valid tokens."""
    gen = torch.Generator().manual_seed(SEED + 100 + index)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
    mask = torch.ones(MBS, SEQ)
    mask[0, SEQ - 1 - index % (SEQ - 2) :] = 0
    if index % 2:
        mask[1, 2] = 0
    return tokens, labels, mask


def _mtp_valid(mask, last_padded):
    """The tokens an MTP router counts under a padding mask, in the router's order: the padding
    mask rolled with the input over the whole sequence; the rolled-in last position reads as
    padded where the base's roll fills a padding flag (dev), as valid where it fills 0."""
    valid = torch.roll(mask != 0, -1, dims=-1)
    valid[:, -1] = not last_padded
    return valid.t().reshape(-1)


def _mtp_mask(mask):
    """The loss mask rolled left by one with the last position cleared (upstream's roll_tensor
    at CP 1): MTP depth 1 predicts token t + 2."""
    rolled = torch.roll(mask, -1, dims=-1)
    rolled[:, -1] = 0
    return rolled


# ------------------------------------------------------------------------------------------
# The model.


def num_layers(case):
    """The case's decoder layers (``LAYERS`` unless it sets 'layers')."""
    return case.get('layers', LAYERS)


def _moe_layer_freq(case):
    """A dense first layer where the case asks for one (``moe_layer_freq`` as a pattern)."""
    if case.get('dense_first'):
        return [0] + [1] * (num_layers(case) - 1)
    return None


def model_config(case, dtype, reference):
    """The TransformerConfig of ``case`` (TP = EP = PP = 1 for the reference)."""
    import torch.nn.functional as F

    from megatron.core.transformer.transformer_config import TransformerConfig

    lay = {} if reference else case['layout']
    tp = lay.get('tp', 1)
    types = list(case['lb'])
    extra = {}
    if types:
        extra['moe_router_load_balancing_type'] = types if len(types) > 1 else types[0]
        coeffs = [AUX_COEFF[t] for t in types]
        extra['moe_aux_loss_coeff'] = coeffs if len(coeffs) > 1 else coeffs[0]
    else:
        extra['moe_router_load_balancing_type'] = 'none'
    if case['z']:
        extra['moe_z_loss_coeff'] = Z_COEFF
    if case['mtp']:
        extra.update(mtp_num_layers=1, mtp_loss_scaling_factor=MTP_SCALE)
    return TransformerConfig(
        num_layers=num_layers(case),
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=lay.get('pp', 1),
        virtual_pipeline_model_parallel_size=lay.get('vpp'),
        expert_model_parallel_size=lay.get('ep', 1),
        expert_tensor_parallel_size=lay.get('etp', tp),
        context_parallel_size=lay.get('cp', 1),
        sequence_parallel=tp > 1,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=MOE_FFN,
        # Upstream's shared expert refuses linear biases: the biased variant runs without it.
        moe_shared_expert_intermediate_size=None if case.get('linear_bias') else SHARED_FFN,
        moe_router_topk=TOPK,
        moe_router_score_function='sigmoid',
        moe_router_enable_expert_bias=case['bias'],
        moe_router_bias_update_rate=BIAS_RATE,
        moe_router_dtype='fp64' if dtype == torch.float64 else 'fp32',
        moe_token_dispatcher_type='allgather',
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=case['per_token'] and not reference,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        add_bias_linear=case.get('linear_bias', False),
        moe_layer_freq=_moe_layer_freq(case) or 1,
        **extra,
    )


def build_model(config, case, vp_stage=None):
    """The GPTModel of this rank's pipeline stage, or of its virtual stage ``vp_stage`` (model
    chunk) under virtual pipeline parallelism (untied embeddings; MTP on the last stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    if case.get('dense_first'):
        # moe_layer_freq picks a dense MLP for the first layer: the block spec of each layer.
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if config.context_parallel_size > 1:
        spec = moe_oracle_cp.layer_spec(spec)
    mtp_spec = None
    if case['mtp']:
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    stage = {}
    if vp_stage is not None:
        stage = dict(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(**stage),
        post_process=ps.is_pipeline_last_stage(**stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type='rope',
        mtp_block_spec=mtp_spec,
        **({'vp_stage': vp_stage} if vp_stage is not None else {}),
    )


def _init_value(key, shape):
    """The float64 value of the whole (global) tensor ``key``: seeded by the key."""
    seed = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=gen, dtype=torch.float64)
    if key.endswith('expert_bias'):
        return value * 0.05
    if 'norm' in key:
        return 1.0 + 0.1 * value
    return value * 0.3


def _sharded_tensors(sharded):
    """The ShardedTensors of a sharded state dict, factories built (swiglu fc1: w and v)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    stack = [sharded]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, ShardedTensorFactory):
            stack.append(item.build())
        elif isinstance(item, ShardedTensor):
            out.append(item)
    return out


def _region(sh):
    """The slices of ``sh``'s data in its global tensor (prepended axes: one index each)."""
    pre = sh.prepend_axis_num
    offs = sh.global_offset
    return tuple(slice(o, o + 1) for o in offs[:pre]) + tuple(
        slice(o, o + n) for o, n in zip(offs[pre:], sh.data.shape)
    )


def _skip(key):
    return 'tokens_per_expert' in key or key.endswith('ga_steps')


def set_weights(module):
    """Every parameter (and the expert bias) from its global key's value."""
    with torch.no_grad():
        for sh in _sharded_tensors(module.sharded_state_dict()):
            if _skip(sh.key):
                continue
            value = _init_value(sh.key, tuple(sh.global_shape))[_region(sh)]
            sh.data.copy_(value.reshape(sh.data.shape).to(sh.data.dtype))


def grads_by_key(module, grads):
    """[(key, global shape, offset, data shape, replica_id, values)] of the gradients ``grads``
    ({param: tensor}), read through the module's own sharded state dict."""
    saved = {}
    for p, g in grads.items():
        saved[p] = p.data
        p.data = g.detach().to(p.dtype).view_as(p)
    try:
        out = []
        for sh in _sharded_tensors(module.sharded_state_dict()):
            if _skip(sh.key) or sh.key.endswith('expert_bias'):
                continue
            out.append(
                (
                    sh.key,
                    list(sh.global_shape),
                    list(sh.global_offset),
                    list(sh.data.shape),
                    list(sh.replica_id) if isinstance(sh.replica_id, tuple) else [sh.replica_id],
                    sh.data.detach().double().flatten().tolist(),
                )
            )
        return out
    finally:
        for p, data in saved.items():
            p.data = data


def _routers(module):
    from megatron.core.transformer.moe.router import TopKRouter

    return [(n, m) for n, m in module.named_modules() if isinstance(m, TopKRouter)]


def _routers_by_key(module, expert_bias=True):
    """{'<decoder|mtp>:<layer number>': router} of the routers (with an expert bias only, unless
    ``expert_bias`` is False)."""
    out = {}
    for name, router in _routers(module):
        if router.expert_bias is not None or not expert_bias:
            where = 'mtp' if name.startswith('mtp.') else 'decoder'
            out[f'{where}:{router.layer_number}'] = router
    return out


def _counting_hook(counts, key, valid):
    """A forward hook adding the router's routing map [tokens, experts] over the valid tokens
    (``valid[0]``: [tokens] in the router's order, sequence-major; None: all; ``valid[1]`` for
    MTP routers: upstream rolls the padding mask with the input and clears the last position,
    so the rolled-in last token routes as a valid one) to counts[key]."""

    def hook(router, args, output):
        routing_map = output[1]
        assert routing_map.dtype == torch.bool and routing_map.shape[-1] == EXPERTS, output
        if valid[0] is not None:
            routing_map = routing_map[valid[1] if key.startswith('mtp') else valid[0]]
        total = routing_map.sum(0).double()
        counts[key] = counts[key] + total if key in counts else total

    return hook


def _logits_hook(logits, key, valid):
    """A forward pre-hook keeping in logits[key] the router's logits of the valid tokens (rows
    of ``valid`` as in :func:`_counting_hook`), computed here from the router's input, weight
    and bias, with their graph: the global aux loss's scores come from them."""

    def hook(router, args):
        flat = args[0].reshape(-1, args[0].shape[-1])
        out = torch.nn.functional.linear(flat, router.weight, router.bias)
        rows = valid[1] if key.startswith('mtp') and valid[0] is not None else valid[0]
        logits[key] = out if rows is None else out[rows]

    return hook


class _GlobalAux:
    """The global load-balancing loss of the reference, written out from its definition
    (tests/scenarios/global_aux_loss.py's helpers; docs/moe-gradients.md, section 10) instead of
    the tree's router: the reference model runs without it, and :meth:`terms` adds, for each DP
    rank's microbatch m, its part of ``coeff * weight_m * L_m`` to that microbatch's objective.

    The scores are the router's score function of the logits that :func:`_logits_hook` keeps
    (no expert bias), over the router's valid tokens; the counts C_m are their top-k over U_m
    (every DP rank's microbatch m: the reference runs those before any of them steps back), and
    f^(m) is over U_0..U_m (constants). Each router also records its value for the tracker:
    DP x its part, which the reference's report scales by 1 / (DP x M), the tracker's mean over
    the step's microbatches of L_m summed over the ranks.
    """

    def __init__(self, module, config, valid):
        self.config = config
        self.routers = _routers_by_key(module, expert_bias=False)
        self.logits = {}
        self.hooks = [
            router.register_forward_pre_hook(_logits_hook(self.logits, key, valid))
            for key, router in self.routers.items()
        ]
        self.counts = {key: [] for key in self.routers}
        self.tokens = {key: [] for key in self.routers}

    def take(self):
        """This forward's logits per router (one DP rank's microbatch)."""
        out = dict(self.logits)
        self.logits.clear()
        return out

    def terms(self, parts, per_token, step_count, microbatches):
        """Per DP rank (``parts``: its logits per router, in DP rank order, microbatch m of
        each, m = the number of earlier calls): its global aux term in the objective, the
        coefficient and weight included."""
        from tests.scenarios import global_aux_loss as definition

        config = self.config
        out = [0.0] * len(parts)
        for key, router in self.routers.items():
            scored = [
                definition.scores_and_routing(
                    part[key], config.moe_router_topk, config.moe_router_score_function
                )
                for part in parts
            ]
            self.counts[key].append(sum(routing.sum(0) for _, routing in scored))
            self.tokens[key].append(float(sum(scores.shape[0] for scores, _ in scored)))
            total = self.tokens[key][-1]
            f = definition.running_fractions(
                self.counts[key], self.tokens[key], config.moe_router_topk
            )[-1]
            weight = definition.objective_weight(per_token, total, step_count, microbatches)
            for r, (scores, _) in enumerate(scored):
                share = definition.loss_share(f, scores, total)
                out[r] = out[r] + AUX_COEFF['global_aux_loss'] * weight * share
                self._record(router, len(parts) * share.detach())
        return out

    def _record(self, router, value):
        """Into the tracker under the router's name and layer, as its router records it."""
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        config = self.config
        layers = config.num_layers + (config.mtp_num_layers or 0)
        number = router.layer_number + (config.num_layers if router.is_mtp_layer else 0)
        get_moe_metrics_tracker().record(
            'global_load_balancing_loss', value, number, layers, needs_dp_avg=False
        )

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def _router_state(module):
    """{'<decoder|mtp>:<layer number>': (expert bias, tokens per expert)} of every router."""
    out = {}
    for name, router in _routers(module):
        if router.expert_bias is None:
            continue
        where = 'mtp' if name.startswith('mtp.') else 'decoder'
        out[f'{where}:{router.layer_number}'] = (
            router.expert_bias.detach().double().tolist(),
            router.local_tokens_per_expert.detach().double().tolist(),
        )
    return out


# ------------------------------------------------------------------------------------------
# The logged MoE metrics.


class _Scalars:
    """Stands in for TensorBoard's ``SummaryWriter``: keeps what the tracker's ``report`` writes
    (each metric's mean over the MoE layers, and ``moe/<name>_layer_<i>``)."""

    def __init__(self):
        self.values = {}

    def add_scalar(self, name, value, iteration):
        self.values[name] = float(value)


def report_metrics(case, loss_scale, pg_collection=None):
    """{name: value} that the MoE metrics tracker's ``report`` logs for this step, called as a
    library user calls it (no ``force_initialize``; megatron.training forces it), with per-layer
    logging. Raises what ``report`` raises."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    writer = _Scalars()
    get_moe_metrics_tracker().report(
        loss_scale=loss_scale,
        iteration=1,
        writer=writer,
        per_layer_logging=True,
        num_layers=num_layers(case),
        moe_layer_freq=_moe_layer_freq(case),
        mtp_num_layers=1 if case['mtp'] else None,
        pg_collection=pg_collection,
    )
    return writer.values


def _timed_pp_collection(timeout_s=5):
    """Where a pipeline stage has no MoE layer, a tracker without 0036's name agreement
    all-reduces a metric over PP on the MoE stage only and waits for ever: ``report`` gets a
    gloo PP group that times out instead (world = PP here), and the data-parallel group."""
    import datetime
    import types

    from megatron.core import parallel_state as ps
    from tests.harness.group_cache import uncached_new_group

    ranks = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    assert len(ranks) == torch.distributed.get_world_size(), ranks
    # Not the harness's cached group: once timed out, gloo has closed its pairs.
    group = uncached_new_group(ranks, backend='gloo', timeout=datetime.timedelta(seconds=timeout_s))
    return types.SimpleNamespace(pp=group, dp=ps.get_data_parallel_group(), dp_cp_gtp_remat=None)


# ------------------------------------------------------------------------------------------
# The reference: one process, plain autograd.


@contextlib.contextmanager
def _upstream_state():
    """Empties the MoE and MTP trackers before and after, and restores the aux-loss and MTP
    loss scales (class attributes that outlive a model) after."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    saved = (
        MoEAuxLossAutoScaler.main_loss_backward_scale,
        MTPLossAutoScaler.main_loss_backward_scale,
    )
    try:
        _clear_metrics()
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved[0]
        MTPLossAutoScaler.main_loss_backward_scale = saved[1]
        _clear_metrics()


def _reference_run(case, dtype):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    try:
        with _upstream_state():
            return _reference_step(case, dtype)
    finally:
        ps.destroy_model_parallel()


def _reference_step(case, dtype):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    # The global aux loss is not the tree's here: _GlobalAux writes it out from its definition.
    lb = [t for t in case['lb'] if t != 'global_aux_loss']
    config = model_config(dict(case, lb=lb), dtype, reference=True)
    module = build_model(config, case).to(dtype)
    set_weights(module)
    bias0 = {k: bias for k, (bias, _) in _router_state(module).items()}
    module.train()
    dp, mbs = case['dp'], NUM_MICROBATCHES
    batches = [microbatch(i) for i in range(dp * mbs)]
    step_count = sum(float(m.sum()) for _, _, m in batches)
    mtp_step_count = sum(float(_mtp_mask(m).sum()) for _, _, m in batches)
    counts = {}
    valid = []
    hooks = [
        router.register_forward_hook(_counting_hook(counts, key, valid))
        for key, router in _routers_by_key(module).items()
    ]
    gaux = _GlobalAux(module, config, valid) if len(lb) < len(case['lb']) else None
    # Microbatch m of every DP rank (U_m) forward, then each of them backward: the global aux
    # loss of U_m counts the tokens of all of them. The aux-loss and MTP scales are read in the
    # backward.
    for m in range(mbs):
        passes = []
        for tokens, labels, mask in batches[m::mbs]:
            valid[:] = (
                [(mask != 0).t().reshape(-1), _mtp_valid(mask, case['mtp_last_padded'])]
                if case['pad']
                else [None]
            )
            count = float(mask.sum())
            router_count = count if case['pad'] else float(mask.numel())
            cp = case['cp']
            cp_counts = None
            if cp > 1:
                owner = moe_oracle_cp.owner(cp, SEQ)
                per_rank = torch.stack([mask[:, owner == r].sum() for r in range(cp)])
                cp_counts = per_rank[owner].to(dtype).expand(MBS, SEQ)
            w_main, w_aux = objective_weights(
                case['per_token'], count, router_count, step_count, dp, mbs, cp, cp_counts
            )
            mtp_router_factor = 1.0
            w_mtp = None
            if case['mtp']:
                mtp_count = float(_mtp_mask(mask).sum())
                w_mtp = mtp_weight(
                    case['per_token'], mtp_count, mtp_step_count, step_count, dp, mbs
                )
                # The MTP routers count their own tokens, the padding mask rolled left by one:
                # its last position padded on dev (a sequence's first valid token drops out of
                # the count), valid on the releases (as many tokens as the decoder's routers).
                mtp_router_count = float(valid[1].sum()) if case['pad'] else router_count
                _, w_mtp_aux = objective_weights(
                    case['per_token'], count, mtp_router_count, step_count, dp, mbs, cp, cp_counts
                )
                mtp_router_factor = w_mtp_aux / w_aux
            with _mtp_router_losses_scaled(module, mtp_router_factor):
                out = _forward(module, case, tokens, labels, mask)
            objective = (out * mask.to(out.dtype) * w_main).sum()
            passes.append((objective, w_aux, w_mtp, gaux.take() if gaux else None))
        terms = [0.0] * len(passes)
        if gaux is not None:
            terms = gaux.terms([p[-1] for p in passes], case['per_token'], step_count, mbs)
        for (objective, w_aux, w_mtp, _), term in zip(passes, terms):
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(w_aux, dtype=dtype))
            if w_mtp is not None:
                MTPLossAutoScaler.set_loss_scale(torch.tensor(w_mtp, dtype=dtype))
            (objective + term).backward()
    if gaux is not None:
        gaux.remove()
    grads = {p: p.grad for p in module.parameters() if p.grad is not None}
    res = {'grads': grads_by_key(module, grads)}
    # The tokens per expert of the step: each router's routing map over the valid tokens
    # (all tokens without a padding mask), counted here, not by the router's own counter.
    for hook in hooks:
        hook.remove()
    res['counts'] = {k: v.tolist() for k, v in counts.items()}
    res['bias0'] = bias0
    # What the tracker logs for the step: the mean over the step's microbatches.
    res['metrics'] = report_metrics(case, 1.0 / (dp * mbs))
    return res


@contextlib.contextmanager
def _mtp_router_losses_scaled(module, factor):
    """Multiply the aux losses and z-loss that the MTP routers of ``module`` attach in the
    forward by ``factor``: their weight in the objective (an aux loss covers its own router's
    tokens) differs from the decoder routers' where the MTP routers count other tokens, and
    MoEAuxLossAutoScaler has one backward scale for every router."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if factor == 1.0:
        yield
        return
    assert 'apply' not in vars(MoEAuxLossAutoScaler)
    apply = MoEAuxLossAutoScaler.apply

    def scaled(activation, loss):
        return apply(activation, loss * factor)

    def enter(router, args):
        MoEAuxLossAutoScaler.apply = scaled

    def leave(router, args, output):
        del MoEAuxLossAutoScaler.apply

    hooks = []
    for name, router in _routers(module):
        if name.startswith('mtp.'):
            hooks += [router.register_forward_pre_hook(enter), router.register_forward_hook(leave)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        if 'apply' in vars(MoEAuxLossAutoScaler):
            del MoEAuxLossAutoScaler.apply


def _forward(module, case, tokens, labels, mask, position_ids=None):
    if position_ids is None:
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()
    kwargs = {'labels': labels}
    if case['mtp']:
        kwargs['loss_mask'] = mask
    if case['pad']:
        kwargs['padding_mask'] = mask == 0
    return module(tokens, position_ids, None, **kwargs)


def _clear_metrics():
    """Empty the MoE and MTP trackers: their entries outlive a model (dev's MTP tracker also
    refuses a per-token case after a mean-loss one)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker = {}
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return
    get_moe_metrics_tracker().metrics.clear()


@contextlib.contextmanager
def _cpu_stand_ins():
    """What the CPU ranks lack, stood in for the whole call:

    - the CUDA RNG tracker's fork has no state: a no-op (dropout is 0);
    - torch.compile (the router's jit_fuser): eager, as tests/scenarios/moe_candidates.py
      (the CUDA-on-CPU redirect does not run under dynamo; compiling also costs most of a call);
    - torch's LayerNorm under sequence parallelism: ``common.torch_norm_sequence_parallel``.
    """
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    compiled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        with common.torch_norm_sequence_parallel():
            yield
    finally:
        torch._dynamo.config.disable = compiled
        del tracker.fork


def scenario_reference(ctx, cases):
    """Per case: the float64 and float32 one-process runs (a world of one rank)."""
    with _cpu_stand_ins():
        return _reference_cases(cases)


def _reference_cases(cases):
    out = []
    for case in cases:
        res = {'name': case['name']}
        try:
            r64 = _reference_run(case, torch.float64)
            r32 = _reference_run(case, torch.float32)
            res['ref64'] = r64['grads']
            res['ref32_flat'] = [v for *_, v in r32['grads']]
            res['counts'] = r64['counts']
            res['bias0'] = r64['bias0']
            res['metrics64'] = r64['metrics']
            res['metrics32'] = r32['metrics']
        except Exception as exc:  # noqa: BLE001 - reported per case
            import traceback

            traceback.print_exc()
            res['error'] = f'{type(exc).__name__}: {exc}'[:400]
        out.append(res)
    return {'cases': out}


# ------------------------------------------------------------------------------------------
# The parallel run.


def _gather_distopt_shards(model):
    """All-gather each bucket's reduce-scattered grad shard over its DP group, so that every
    main_grad holds the whole reduced gradient (as without the distributed optimizer)."""
    groups = list(model.bucket_groups) + list(getattr(model, 'expert_parallel_bucket_groups', []))
    for bucket_group in groups:
        group = getattr(bucket_group, 'intra_distributed_optimizer_instance_group', None)
        if group is None:
            group = bucket_group.data_parallel_group
        size = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        for bucket in bucket_group.buckets:
            shards = list(bucket.grad_data.view(size, -1).unbind(0))
            local = shards[rank].clone()
            torch.distributed.all_gather(shards, local, group=group)


@contextlib.contextmanager
def _recording_bias_counts(out):
    """Record the stacked tokens per expert that finalize_model_grads' expert-bias update
    all-reduces (in place) into ``out``."""
    import importlib

    module = importlib.import_module('megatron.core.distributed.finalize_model_grads')
    original = module.get_updated_expert_bias

    def recording(tokens_per_expert, *args, **kwargs):
        updated = original(tokens_per_expert, *args, **kwargs)
        out.append(tokens_per_expert.detach().double().clone())
        return updated

    module.get_updated_expert_bias = recording
    try:
        yield
    finally:
        module.get_updated_expert_bias = original


def _step(chunks, forward_step, batches):
    """One step of the schedule over the model chunks (the interleaved one where there are
    several: each chunk reads the microbatches from its own iterator)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks,
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=False,
    )


def _parallel_run(ctx, case):
    from megatron.core import parallel_state as ps

    lay = case['layout']
    ps.initialize_model_parallel(
        tensor_model_parallel_size=lay.get('tp', 1),
        pipeline_model_parallel_size=lay.get('pp', 1),
        expert_model_parallel_size=lay.get('ep', 1),
        expert_tensor_parallel_size=lay.get('etp'),
        context_parallel_size=lay.get('cp', 1),
        virtual_pipeline_model_parallel_size=lay.get('vpp'),
    )
    try:
        with _upstream_state():
            assert ps.get_data_parallel_world_size() == case['dp'], case
            return _parallel_step(case)
    finally:
        ps.destroy_model_parallel()


def _parallel_step(case):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    config = model_config(case, torch.float32, reference=False)
    vpp = case['layout'].get('vpp')
    # One model chunk per virtual stage under virtual pipeline parallelism (else one).
    modules = (
        [build_model(config, case, i) for i in range(vpp)] if vpp else [build_model(config, case)]
    )
    chunks = []
    for i, module in enumerate(modules):
        set_weights(module)
        chunks.append(
            DistributedDataParallel(
                config,
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True,
                    use_distributed_optimizer=case['distopt'],
                    overlap_grad_reduce=False,
                ),
                module,
                disable_bucketing=i > 0,  # as megatron.training's get_model
            )
        )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in chunks] if vpp else chunks[0].no_sync
    config.grad_sync_func = None
    config.param_sync_func = None
    config.grad_scale_func = None
    config.timers = None
    dp_rank = ps.get_data_parallel_rank()
    batches = [microbatch(dp_rank * NUM_MICROBATCHES + m) for m in range(NUM_MICROBATCHES)]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()
    if ps.get_context_parallel_world_size() > 1:
        # Each CP rank's part of each microbatch, by upstream's get_batch_on_this_cp_rank.
        names = ('tokens', 'labels', 'loss_mask', 'position_ids')
        group = ps.get_context_parallel_group()
        parts = [moe_oracle_cp.split(dict(zip(names, (*b, position_ids))), group) for b in batches]
        batches = [tuple(p[n] for n in names[:3]) for p in parts]
        position_ids = parts[0]['position_ids']

    def forward_step(data_iterator, model):
        tokens, labels, mask = next(data_iterator)
        output = _forward(model, case, tokens, labels, mask, position_ids)

        def loss_func(output_tensor):
            loss = (output_tensor.float() * mask).sum()
            num_tokens = mask.sum().to(torch.int)
            return loss, num_tokens, {'lm loss': torch.stack([loss.detach(), mask.sum()])}

        return output, loss_func

    for model in chunks:
        model.zero_grad_buffer()
    reduced = []
    with _recording_bias_counts(reduced):
        _step(chunks, forward_step, batches)
    if case['distopt']:
        for model in chunks:
            _gather_distopt_shards(model)
    try:
        pp = case['layout'].get('pp', 1)
        pgc = _timed_pp_collection() if case.get('dense_first') and pp > 1 else None
        metrics = report_metrics(case, 1.0 / NUM_MICROBATCHES, pgc)
    except Exception as exc:  # noqa: BLE001 - upstream's error is the result
        metrics = {'error': f'{type(exc).__name__}: {exc}'[:300]}
    if pgc is not None:
        # A stage whose report() waited out the PP group's timeout is that much behind the other:
        # leave the case together, so that no later call's collective starts one-sided.
        torch.distributed.barrier()
    grads = []
    routers = {}  # in finalize_model_grads' order: chunk by chunk
    for module in modules:
        main_grads = {p: p.main_grad for p in module.parameters() if p.requires_grad}
        grads += grads_by_key(module, main_grads)
        routers.update(_router_state(module))
    return {
        'metrics': metrics,
        'grads': grads,
        'bias': {k: bias for k, (bias, _) in routers.items()},
        # The tokens per expert the expert-bias update used (reduced over TP x DP x CP).
        'counts': dict(zip(routers, reduced[0].tolist())) if reduced else {},
        'stage': ps.get_pipeline_model_parallel_rank(),
    }


def scenario_parallel(ctx, cases):
    """Per case: this rank's gradients (global keys) after the step, or the error."""
    with _cpu_stand_ins():
        return _parallel_cases(ctx, cases)


def _parallel_cases(ctx, cases):
    out = []
    for case in cases:
        res = {'name': case['name']}
        try:
            res.update(_parallel_run(ctx, case))
        except Exception as exc:  # noqa: BLE001 - upstream's error is the result
            import traceback

            traceback.print_exc()
            res['error'] = f'{type(exc).__name__}: {exc}'[:400]
        out.append(res)
    return {'cases': out}


# ------------------------------------------------------------------------------------------
# Reading the results (tests/test_moe_oracle.py and the demo's MoE row).


def region(off, shape):
    """The slices of a parameter region (a ShardedTensor's global offset and local shape)."""
    pre = len(off) - len(shape)
    return tuple(slice(o, o + 1) for o in off[:pre]) + tuple(
        slice(o, o + n) for o, n in zip(off[pre:], shape)
    )


def assemble(entries, values=None):
    """{key: global float64 tensor} from (key, global shape, offset, shape, replica, values)."""
    out = {}
    for i, (key, gshape, off, shape, _rep, vals) in enumerate(entries):
        tensor = out.setdefault(key, torch.zeros(gshape, dtype=torch.float64))
        sl = region(off, shape)
        vals = vals if values is None else values[i]
        tensor[sl] = torch.tensor(vals, dtype=torch.float64).reshape(tensor[sl].shape)
    return out


def region_error(r64, r32, key, off, shape, vals):
    """(error, bound) of one parameter region: its largest distance from the float64 reference,
    and 8x the float32 run's distance plus 16 float32 eps of the largest element."""
    sl = region(off, shape)
    want = r64[key][sl].reshape(shape)
    dist = float((r32[key][sl].reshape(shape) - want).abs().max())
    bound = 8 * dist + 16 * torch.finfo(torch.float32).eps * float(want.abs().max())
    value = torch.tensor(vals, dtype=torch.float64).reshape(shape)
    return float((value - want).abs().max()), bound


def router_grad_error(per_rank, reference, name):
    """The case ``name``'s routers' weight gradients on every rank against the float64 one:
    ('error', message) or ('grads', worst error / bound, worst error / largest float64 element).
    ``per_rank``: scenario_parallel's result; ``reference``: scenario_reference's (world 1)."""
    ref = {c['name']: c for c in reference[0]['cases']}[name]
    if 'error' in ref:
        return 'error', 'reference: ' + ref['error']
    r64, r32 = assemble(ref['ref64']), assemble(ref['ref64'], ref['ref32_flat'])
    worst = (0.0, 0.0)
    for res in per_rank:
        got = {c['name']: c for c in res['cases']}[name]
        if 'error' in got:
            return 'error', got['error']
        for key, _gshape, off, shape, _rep, vals in got['grads']:
            if '.router.weight' in key:
                err, bound = region_error(r64, r32, key, off, shape, vals)
                scale = float(r64[key].abs().max())
                worst = max(worst, (err / bound, err / scale))
    return 'grads', worst[0], worst[1]
