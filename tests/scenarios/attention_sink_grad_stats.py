"""Scenarios: grad statistics of the learnable attention-sink offset under TP (patch 0008).

``DotProductAttention(softmax_type='learnable')`` (the local-spec core attention) holds one
``softmax_offset`` value per local head: the parameter is head-sharded over TP, like the QKV
weight. The grad norm, the zero count and the param norm keep a parameter on every TP rank only if
it is marked tensor-parallel; otherwise they count it on TP rank 0 only, as for a replicated
LayerNorm weight. Every scenario here builds the real layer and measures the statistics through
DDP and ``get_megatron_optimizer``; expected values never come from megatron: they are closed forms
or FP64 reductions over the *logical* (unsharded) parameters.

Logical model: ``attn.softmax_offset`` (HEADS values, HEADS / TP per TP rank), ``dense``
(DENSE values, replicated over TP and DP) and, in the layout scenario, ``expert`` (EXPERT values
per EP rank, ``allreduce=False``, replicated over ETP and expert DP).
"""

import contextlib
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.scenarios.common import (
    ddp_and_optimizer,
    import_with_real_cuda,
    oracle,
    parallel_layout,
    read_grad_stats,
)

HEADS, HEAD_DIM, DENSE, EXPERT = 4, 2, 3, 3
SEQ, BATCH = 5, 2
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}


def _config(tp, dtype, perform_initialization=False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        kv_channels=HEAD_DIM,
        tensor_model_parallel_size=tp,
        softmax_type='learnable',
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bf16=dtype == 'bf16',
        params_dtype=DTYPES[dtype],
        perform_initialization=perform_initialization,
    )


def _model(ctx, config, expert):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class _SinkModel(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.attn = DotProductAttention(
                config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type='self'
            )
            dtype = config.params_dtype
            self.dense = torch.nn.Parameter(torch.zeros(DENSE, dtype=dtype, device=ctx.device))
            if expert:
                self.expert = torch.nn.Parameter(
                    torch.zeros(EXPERT, dtype=dtype, device=ctx.device)
                )
                self.expert.allreduce = False

        def forward(self, query, key, value, weight, coeff):
            context = self.attn(query, key, value, None)
            return (context.float() * weight).sum() + (self.dense.float() * coeff).sum()

    return _SinkModel()


def _build(
    ctx,
    tp,
    dtype,
    distopt,
    expert=False,
    optimizer='adam',
    clip_grad=0.0,
    lr=0.0,
    perform_initialization=False,
):
    config = _config(tp, dtype, perform_initialization)
    model, optimizer = ddp_and_optimizer(
        config,
        _model(ctx, config, expert),
        distopt,
        optimizer=optimizer,
        lr=lr,
        weight_decay=0.0,
        sgd_momentum=0.0,
        params_dtype=DTYPES[dtype],
        clip_grad=clip_grad,
        log_num_zeros_in_grad=True,
    )
    return config, model, optimizer


def _tp_coords():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _heads(tp_rank, tp):
    per = HEADS // tp
    return slice(tp_rank * per, (tp_rank + 1) * per)


def _stats(model, optimizer, values):
    module = model.module
    params = {'softmax_offset': module.attn.softmax_offset, 'dense': module.dense}
    if 'expert' in values:
        params['expert'] = module.expert
    return read_grad_stats(optimizer, [(params[n], v) for n, v in values.items()])


def _param_norm(model, dtype):
    """megatron.training's calc_params_l2_norm (logged as params-norm) on this model."""
    import_with_real_cuda('megatron.training.utils')
    from megatron.training import global_vars
    from megatron.training.utils import calc_params_l2_norm

    global_vars._GLOBAL_ARGS = SimpleNamespace(bf16=dtype == 'bf16', use_megatron_fsdp=False)
    try:
        return float(calc_params_l2_norm([model]))
    finally:
        global_vars._GLOBAL_ARGS = None


def scenario_exact(ctx, tp, dtype, distopt):
    """Closed forms: all-ones grads -> norm sqrt(HEADS + DENSE); zero grads -> HEADS + DENSE zeros;
    all-ones params -> param norm sqrt(HEADS + DENSE).

    Also reports the TP attributes the layer put on softmax_offset.
    """
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    _, model, optimizer = _build(ctx, tp, dtype, distopt)
    offset = model.module.attn.softmax_offset
    local = offset.numel()
    ones = _stats(model, optimizer, {'softmax_offset': torch.ones(local), 'dense': torch.ones(3)})
    zeros = _stats(
        model, optimizer, {'softmax_offset': torch.zeros(local), 'dense': torch.zeros(3)}
    )
    with torch.no_grad():
        for param in model.module.parameters():
            param.fill_(1.0)
    optimizer.reload_model_params()
    return {
        'local_heads': local,
        'tensor_model_parallel': getattr(offset, 'tensor_model_parallel', None),
        'partition_dim': getattr(offset, 'partition_dim', None),
        'partition_stride': getattr(offset, 'partition_stride', None),
        'found_inf': ones['found_inf'] or zeros['found_inf'],
        'norm': ones['norm'],
        'zeros': zeros['zeros'],
        'param_norm': _param_norm(model, dtype),
        'expected_norm': math.sqrt(HEADS + DENSE),
        'expected_zeros': HEADS + DENSE,
    }


def _inputs(seed):
    """Full-head (logical) inputs, identical on every rank: q, k, v [s, b, H, d], the output
    weight [s, b, H * d], the dense coefficient and the logical sink offsets [H]."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen).double() for _ in range(3))
    weight = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=gen).double()
    coeff = torch.randn(DENSE, generator=gen).double()
    offset = torch.randn(HEADS, generator=gen).double()
    return q, k, v, weight, coeff, offset


def _reference_offset_grad(q, k, v, weight, offset):
    """FP64 plain-torch attention with a learnable sink (no megatron): d loss / d offset."""
    offset = offset.clone().requires_grad_(True)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    # [b, H, s, s]
    scores = torch.einsum('sbhd,tbhd->bhst', q, k) * scale
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(causal, -10000.0)
    sink = offset.reshape(1, -1, 1, 1).expand(BATCH, -1, SEQ, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    context = torch.einsum('bhst,tbhd->sbhd', probs, v).reshape(SEQ, BATCH, HEADS * HEAD_DIM)
    (context * weight).sum().backward()
    return offset.grad


def scenario_backward_clip(ctx, tp, dtype, distopt, seed=7, clip_grad=1e-3):
    """A real forward/backward through DotProductAttention, then one clipped SGD step (lr 1).

    Every rank feeds the same logical inputs (its TP rank's heads), so DDP's DP average leaves them
    unchanged. Returns:
    - ``norm``: the optimizer's grad norm; ``oracle_norm``: FP64 norm of the logical grads, built
      by gathering every TP rank's softmax_offset main_grad (plus the replicated dense grad once);
    - ``offset_grad`` / ``reference_offset_grad``: the gathered logical sink grad and a plain-torch
      FP64 reference of it (the layer's grads are right; only their statistics can be wrong);
    - ``update_norm``: FP64 norm of the logical parameter update of the clipped SGD step, which
      must equal ``clip_grad`` when the true norm exceeds it.
    """
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_rank, tp_size = _tp_coords()
    # The distributed optimizer is Adam-only, whose first update does not scale with the clip
    # coefficient: the update check runs with SGD (no distributed optimizer) only.
    sgd = not distopt
    _, model, optimizer = _build(
        ctx,
        tp,
        dtype,
        distopt,
        optimizer='sgd' if sgd else 'adam',
        clip_grad=clip_grad,
        lr=1.0 if sgd else 0.0,
    )
    q, k, v, weight, coeff, offset = _inputs(seed)
    heads = _heads(tp_rank, tp_size)
    dt = DTYPES[dtype]
    with torch.no_grad():
        model.module.attn.softmax_offset.copy_(offset[heads].to(dt))
        model.module.dense.copy_(torch.zeros(DENSE, dtype=dt))
    optimizer.reload_model_params()
    before = _logical_params(model, optimizer, ctx)

    _forward_backward(ctx, model, optimizer, (q, k, v, weight, coeff), heads, dt)
    assert model.module.attn.softmax_offset.main_grad.numel() == HEADS // tp_size
    local_grad = model.module.attn.softmax_offset.main_grad.detach().double().cpu()
    offset_grad = _gather_tp(local_grad, ctx)
    dense_grad = model.module.dense.main_grad.detach().double().cpu()
    oracle_norm = math.sqrt(float(offset_grad.pow(2).sum() + dense_grad.pow(2).sum()))
    ok, norm, zeros = optimizer.step()
    after = _logical_params(model, optimizer, ctx)
    update = torch.cat([a - b for a, b in zip(after, before)])
    return {
        'ok': bool(ok),
        'norm': float(norm),
        'oracle_norm': oracle_norm,
        'offset_grad': offset_grad.tolist(),
        'reference_offset_grad': _reference_offset_grad(q, k, v, weight, offset).tolist(),
        'update_norm': float(update.norm()) if sgd else None,
        'clip_grad': clip_grad,
    }


def _forward_backward(ctx, model, optimizer, inputs, heads, dt):
    """One real forward/backward of this TP rank's heads of the logical inputs, grads synced."""
    from megatron.core import tensor_parallel

    q, k, v, weight, coeff = inputs
    model.zero_grad_buffer()
    optimizer.zero_grad()
    # Attention dropout is 0; its CUDA RNG fork has no state on CPU ranks, so it is skipped here.
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    local_w = weight.reshape(SEQ, BATCH, HEADS, HEAD_DIM)[:, :, heads].reshape(SEQ, BATCH, -1)
    try:
        loss = model(
            q[:, :, heads].to(dt).to(ctx.device),
            k[:, :, heads].to(dt).to(ctx.device),
            v[:, :, heads].to(dt).to(ctx.device),
            local_w.float().to(ctx.device),
            coeff.float().to(ctx.device),
        )
    finally:
        del tracker.fork
    loss.backward()
    model.finish_grad_sync()


def scenario_initialized(ctx, tp, dtype, distopt, seed=11):
    """The layer as built with perform_initialization=True (the default; the other scenarios
    set the values themselves), one real backward and an Adam step of lr 0.

    The output weight of the last head is zero, so that head's offset grad is exactly zero (it
    sits on the last TP rank): the zero count sees it only when that rank's sink is counted.

    Returns the TP-gathered initial offset ('init_offset', and this rank's 'local_offset'), the
    optimizer's grad norm and zero count, megatron.training's param norm, and FP64 oracles of
    each over the logical params and grads ('oracle_*') and over TP rank 0's heads only
    ('tp0_only_*', what a statistic that skips the other TP ranks' sinks reports).
    """
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_rank, tp_size = _tp_coords()
    torch.manual_seed(seed)
    _, model, optimizer = _build(ctx, tp, dtype, distopt, perform_initialization=True)
    offset = model.module.attn.softmax_offset
    local_init = offset.detach().double().cpu()
    init_offset = _gather_tp(local_init, ctx)

    q, k, v, weight, coeff, _ = _inputs(seed)
    weight.view(SEQ, BATCH, HEADS, HEAD_DIM)[:, :, -1] = 0.0
    heads = _heads(tp_rank, tp_size)
    _forward_backward(ctx, model, optimizer, (q, k, v, weight, coeff), heads, DTYPES[dtype])
    offset_grad = _gather_tp(offset.main_grad.detach().double().cpu(), ctx)
    dense_grad = model.module.dense.main_grad.detach().double().cpu()
    ok, norm, zeros = optimizer.step()
    params = {
        'offset': _gather_tp(offset.detach().double().cpu(), ctx),
        'dense': model.module.dense.detach().double().cpu(),
    }
    grads = {'offset': offset_grad, 'dense': dense_grad}
    tp0 = _heads(0, tp_size)
    grads_tp0 = dict(grads, offset=offset_grad[tp0])
    params_tp0 = torch.cat([params['offset'][tp0], params['dense']])
    return {
        'ok': bool(ok),
        'tensor_model_parallel': getattr(offset, 'tensor_model_parallel', None),
        'local_offset': local_init.tolist(),
        'init_offset': init_offset.tolist(),
        'norm': float(norm),
        'zeros': int(zeros),
        'param_norm': _param_norm(model, dtype),
        **oracle(grads),
        'tp0_only_norm': oracle(grads_tp0)['oracle_norm'],
        'tp0_only_zeros': oracle(grads_tp0)['oracle_zeros'],
        'oracle_param_norm': float(torch.cat(list(params.values())).norm()),
        'tp0_only_param_norm': float(params_tp0.norm()),
        'offset_grad': offset_grad.tolist(),
        'reference_offset_grad': _reference_offset_grad(
            q, k, v, weight, init_offset.to(DTYPES[dtype]).double()
        ).tolist(),
    }


def _gather_tp(local, ctx):
    """Concatenate a 1-D CPU FP64 tensor over the TP group in TP-rank order."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.zeros_like(local).to(ctx.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.to(ctx.device), group=group)
    return torch.cat([p.cpu() for p in parts])


def _main_param(optimizer, param):
    """The fp32 copy the optimizer updates for ``param`` (the param itself without one)."""
    for child in getattr(optimizer, 'chained_optimizers', [optimizer]):
        for model_group, main_group in zip(
            getattr(child, 'float16_groups', []), getattr(child, 'fp32_from_float16_groups', [])
        ):
            for model_param, main_param in zip(model_group, main_group):
                if model_param is param:
                    return main_param
    return param


def _logical_params(model, optimizer, ctx):
    """Logical (TP-gathered) FP64 values of the params as the optimizer holds them."""
    module = model.module
    offset = _main_param(optimizer, module.attn.softmax_offset).detach().double().cpu()
    return [_gather_tp(offset, ctx), _main_param(optimizer, module.dense).detach().double().cpu()]


def layouts(world_size):
    """Every (tp, ep, etp) with PP = CP = 1 that fits ``world_size`` ranks (TP divides HEADS)."""
    from tests.scenarios.expert_grad_stats import layouts as expert_layouts

    return [layout for layout in expert_layouts(world_size) if HEADS % layout[0] == 0]


def _draw(gen, n):
    # Multiples of 1/8 in [-2, 2] (exact in bf16), about 1 in 5 set to zero.
    vals = torch.randint(-16, 17, (n,), generator=gen).double() / 8.0
    return vals.masked_fill(torch.rand(n, generator=gen) < 0.2, 0.0)


def _draw_grads(seed, ep, heads, ep_rank, with_expert):
    """The logical values of one seed and this rank's shard of them: (logical, local)."""
    gen = torch.Generator().manual_seed(seed)
    logical = {
        'softmax_offset': _draw(gen, HEADS),
        'dense': _draw(gen, DENSE),
        'expert': torch.stack([_draw(gen, EXPERT) for _ in range(ep)]),
    }
    local = {
        'softmax_offset': logical['softmax_offset'][heads].float(),
        'dense': logical['dense'].float(),
        'expert': logical['expert'][ep_rank].float(),
    }
    if not with_expert:
        del logical['expert'], local['expert']
    return logical, local


def _load_params(model, optimizer, local, with_expert):
    """Copy the local values into the params (the expert ones zeroed) and reload the optimizer."""
    with torch.no_grad():
        module = model.module
        module.attn.softmax_offset.copy_(local['softmax_offset'])
        module.dense.copy_(local['dense'])
        # Expert values stay zero here: the param norm of expert params is a
        # separate matter (it deduplicates them over the dense TP group).
        if with_expert:
            module.expert.zero_()
    optimizer.reload_model_params()


def _case(logical, got, model, dtype, tp):
    """One case's measured statistics next to the FP64 oracles and the TP-rank-0-only values."""
    # What a statistic that keeps the sink on TP rank 0 only would report.
    tp0 = dict(logical, softmax_offset=logical['softmax_offset'][_heads(0, tp)])
    tp0_only = oracle(tp0)
    params = torch.cat([logical['softmax_offset'], logical['dense']])
    params_tp0 = torch.cat([tp0['softmax_offset'], tp0['dense']])
    return {
        'norm': got['norm'],
        'zeros': got['zeros'],
        'param_norm': _param_norm(model, dtype),
        **oracle(logical),
        'tp0_only_norm': tp0_only['oracle_norm'],
        'tp0_only_zeros': tp0_only['oracle_zeros'],
        'oracle_param_norm': float(params.norm()),
        'tp0_only_param_norm': float(params_tp0.norm()),
    }


def scenario_layouts(
    ctx, layout_list, seeds, dtype='bf16', distopt_values=(False, True), with_expert=True
):
    """Random logical grads and params over (tp, ep, etp) layouts: grad norm and zero count
    (sink offset, dense, per-EP expert) and param norm (sink offset and dense; expert values are
    zero) against FP64 oracles over the logical parameters.

    with_expert=False leaves the expert parameter out (for trees whose expert statistics are wrong
    for another reason, so that only the sink offset is measured).
    """
    cases = []
    for tp, ep, etp in layout_list:
        with parallel_layout(tp, ep, etp) as (tp_rank, ep_rank, _):
            heads = _heads(tp_rank, tp)
            for distopt in distopt_values:
                _, model, optimizer = _build(ctx, tp, dtype, distopt, expert=with_expert)
                for seed in seeds:
                    logical, local = _draw_grads(seed, ep, heads, ep_rank, with_expert)
                    got = _stats(model, optimizer, local)
                    _load_params(model, optimizer, local, with_expert)
                    case = _case(logical, got, model, dtype, tp)
                    cases.append(
                        {'layout': [tp, ep, etp], 'distopt': distopt, 'seed': seed, **case}
                    )
                del model, optimizer
    return {'cases': cases}
