"""Scenario: the logged parameter norm after a ``LayerWiseDistributedOptimizer`` step.

``calc_params_l2_norm`` (megatron.training.utils) is read right after ``optimizer.step()``, as
``train_step``'s caller does for ``--log-params-norm``. With ``overlap_param_gather`` the
LayerWise all-gather of updated params is deferred to the next forward's pre-hooks, so at that
point a rank holds updated weights only for the params it owns.

The optimizer is built as ``_get_megatron_emerging_optimizer`` builds it for
``use_layer_wise_distributed_optimizer=True`` (see tests/scenarios/layer_wise_grad_stats.py), with
SGD as the base optimizer (Muon needs the ``emerging-optimizers`` package, not installed here; the
norm does not depend on the update rule). Values are exact in bf16: params ``1 + i / 4``, grads 1,
lr 1/2 and a first SGD step, so every updated param is ``1/2 + i / 4`` and the expected norm is a
closed form, never read from megatron.
"""

import math

import torch

from tests.scenarios.common import ParamBag, import_with_real_cuda, init_parallel, stats_config
from tests.scenarios.layer_wise_grad_stats import layer_wise_ddp, layer_wise_optimizer

# [rows, 2] bf16 matrices (LayerWise manages matrices only); x0 and x1 are experts
# (allreduce=False).
SHAPES = {'w0': 3, 'w1': 2, 'w2': 4, 'w3': 1, 'x0': 1, 'x1': 1}
LR = 0.5
PLAIN_SGD = dict(optimizer='sgd', lr=LR, min_lr=LR, weight_decay=0.0, sgd_momentum=0.0)


def _initial(name):
    base = sum(SHAPES[k] for k in SHAPES if k < name) * 2
    return [1.0 + (base + j) / 4.0 for j in range(SHAPES[name] * 2)]


def _norm(values):
    return math.sqrt(sum(v * v for v in values))


EXPECTED_BEFORE = _norm([v for k in SHAPES for v in _initial(k)])
EXPECTED_AFTER = _norm([v - LR for k in SHAPES for v in _initial(k)])


def _build(ctx, setup, overlap):
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = stats_config('bf16')
    values = {
        name: torch.tensor(_initial(name), dtype=torch.bfloat16).reshape(rows, 2).to(ctx.device)
        for name, rows in SHAPES.items()
    }
    module = ParamBag(values, expert_names=[name for name in SHAPES if name.startswith('x')])
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=setup == 'layout',
        overlap_param_gather=overlap,
        overlap_grad_reduce=overlap,
    )
    model = layer_wise_ddp(cfg, ddp_cfg, module, setup)
    optimizer = layer_wise_optimizer(
        model, setup == 'layout', overlap_param_gather=overlap, **PLAIN_SGD
    )
    return model, optimizer


def scenario_norm_after_step(ctx, setup='layout', overlap=True):
    """calc_params_l2_norm before and right after one step, and the params this rank holds.

    Returns:
        dict with ``before``/``after`` (this rank's calc_params_l2_norm), the closed-form
        ``expected_before``/``expected_after``, and ``stale``: how many param elements this rank
        still holds at their pre-step value after the step (the ones an overlapped gather has not
        refreshed yet).
    """
    from types import SimpleNamespace

    import_with_real_cuda('megatron.training.utils')
    from megatron.training.global_vars import set_args
    from megatron.training.utils import calc_params_l2_norm

    init_parallel()
    set_args(SimpleNamespace(bf16=True, use_megatron_fsdp=False))
    model, optimizer = _build(ctx, setup, overlap)
    before = float(calc_params_l2_norm([model]))
    for param in model.module.parameters():
        param.main_grad.fill_(1.0)
    optimizer.step()
    after = float(calc_params_l2_norm([model]))
    stale = 0
    for name in SHAPES:
        got = getattr(model.module, name).detach().float().reshape(-1)
        stale += int((got == torch.tensor(_initial(name))).sum())
    return {
        'before': before,
        'after': after,
        'expected_before': EXPECTED_BEFORE,
        'expected_after': EXPECTED_AFTER,
        'stale': stale,
    }


# QK-clip (MuonClip's second half, megatron.core.optimizer.qk_clip.clip_qk, run by train_step right
# after optimizer.step()) on a real two-layer TransformerBlock (local spec) under the LayerWise
# optimizer, bf16 and overlapped param gather. Only Transformer Engine's attention records the max
# attention logit per head (current_max_attn_logits); the scenario sets it as TE would leave it
# after a forward, so the real clip_qk, SelfAttention.clip_qk and the deferred gather all run.
QK_HEADS, QK_HEAD_DIM, QK_THRESHOLD, QK_ALPHA = 2, 4, 2.0, 0.5


def _qk_model(ctx):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module, MegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlock

    cfg = stats_config(
        'bf16',
        num_layers=2,
        hidden_size=QK_HEADS * QK_HEAD_DIM,
        num_attention_heads=QK_HEADS,
        kv_channels=QK_HEAD_DIM,
        ffn_hidden_size=8,
        add_bias_linear=False,
        perform_initialization=False,
        qk_clip=True,
        qk_clip_threshold=QK_THRESHOLD,
        qk_clip_alpha=QK_ALPHA,
    )

    class _Model(MegatronModule):
        # clip_qk walks model_chunk.module.module.decoder.layers (DDP, Float16Module, GPTModel).
        def __init__(self):
            super().__init__(config=cfg)
            self.decoder = TransformerBlock(cfg, get_gpt_layer_local_spec())

    module = Float16Module(cfg, _Model().to(ctx.device))
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in module.parameters():
            # Multiples of 1/8 in [-2, 2]: exact in bf16.
            param.copy_(torch.randint(-16, 17, param.shape, generator=gen) / 8.0)
    # LayerWise (Muon) manages the matrices; the layer norms' 1-D weights, which the real set-up
    # hands to a separate Adam, stay frozen here (the shard-aligned layout holds matrices only).
    for param in module.parameters():
        param.requires_grad_(param.dim() == 2)
    return cfg, module


def _set_grads(model):
    """Seeded grads of 1/8 multiples in every trainable param's main_grad; return them (FP64)."""
    gen = torch.Generator().manual_seed(99)
    grads = {}
    for param in model.module.parameters():
        if not param.requires_grad:
            continue
        grads[param] = torch.randint(-8, 9, param.shape, generator=gen).double() / 8.0
        param.main_grad.copy_(grads[param])
    return grads


def _set_max_logits(ctx, layers, rank):
    """Record this rank's per-head max logits on every layer; return the DP max per layer."""
    logits = []
    for index, layer in enumerate(layers):
        local = torch.tensor([3.0 + index + rank, 1.0 + rank / 4.0])
        layer.self_attention.core_attention.current_max_attn_logits = local.to(ctx.device)
        logits.append([3.0 + index + 1, 1.25])  # the DP max (world 2)
    return logits


def _qk_reference(initial, weights, logits, grads):
    """FP64 reference of each clipped linear_qkv weight (see scenario_qk_clip)."""
    reference = []
    rows = QK_HEAD_DIM
    for w0, weight, layer_logits in zip(initial, weights, logits):
        updated = w0 - LR * grads[weight]
        eta = torch.tensor([min(1.0, QK_THRESHOLD / m) for m in layer_logits], dtype=torch.float64)
        blocks = updated.view(QK_HEADS, 3 * rows, -1).clone()
        blocks[:, :rows] *= eta.pow(QK_ALPHA).view(-1, 1, 1)
        blocks[:, rows : 2 * rows] *= eta.pow(1 - QK_ALPHA).view(-1, 1, 1)
        reference.append(blocks.reshape(-1).tolist())
    return reference


def scenario_qk_clip(ctx, setup='layout'):
    """One LayerWise step (SGD, lr 1/2, grads of 1/8 multiples), clip_qk, then the param gather.

    Returns per layer the linear_qkv weight this rank holds right after clip_qk and after the
    gather (bf16 values as float lists), whether this rank owns it (holds a main_param), the
    logged max logit, and an FP64 reference of the clipped, gathered weight.
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.qk_clip import clip_qk

    init_parallel()
    rank = torch.distributed.get_rank()
    cfg, module = _qk_model(ctx)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=setup == 'layout',
        overlap_param_gather=True,
        overlap_grad_reduce=True,
    )
    model = layer_wise_ddp(cfg, ddp_cfg, module, setup)
    optimizer = layer_wise_optimizer(
        model, setup == 'layout', overlap_param_gather=True, **PLAIN_SGD
    )
    layers = list(model.module.module.decoder.layers)
    weights = [layer.self_attention.linear_qkv.weight for layer in layers]
    initial = [w.detach().double().clone() for w in weights]
    grads = _set_grads(model)
    optimizer.step()
    # Per-head max logits as TE records them: different on each DP rank (clip_qk takes the MAX
    # over DP); head 0 of each layer above the threshold, head 1 below it.
    logits = _set_max_logits(ctx, layers, rank)
    max_logit = clip_qk([model])
    owned = [getattr(w, 'main_param', None) is not None for w in weights]
    after_clip = [w.detach().float().reshape(-1).tolist() for w in weights]
    model.start_param_sync(force_sync=True)
    gathered = [w.detach().float().reshape(-1).tolist() for w in weights]

    # FP64 reference: SGD step, then per query group q rows times eta^alpha and k rows times
    # eta^(1 - alpha), eta = min(1, threshold / max logit); v rows unchanged.
    reference = _qk_reference(initial, weights, logits, grads)
    return {
        'max_logit': float(max_logit),
        'expected_max_logit': max(max(v) for v in logits),
        'owned': owned,
        'after_clip': after_clip,
        'gathered': gathered,
        'reference': reference,
    }
