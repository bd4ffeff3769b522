"""Scenario: MTP loss under ``calculate_per_token_loss`` with uneven loss masks over DP.

A tiny ``LanguageModule`` calls the real ``process_mtp_loss`` the way ``GPTModel`` does: the
decoder output is the dim-0 concatenation ``[main, mtp_1, ..., mtp_D]``, the output layer is a
real ``ColumnParallelLinear`` and the loss is the module's own ``compute_language_model_loss``.
It is wrapped in megatron DDP and stepped by the real no-pipelining schedule with
``finalize_model_grads``; the loss function returns ``(sum, num_tokens, ...)``, so the schedule
counts tokens and ``finalize_model_grads`` divides every gradient by the global token count.

The expected gradients never come from megatron: a float64 copy of the model computes, in one
process over the whole global batch, the objective that per-token loss means,

    J = sum(main loss) / N + scale / D * sum_k sum(MTP_k loss) / M_k,

with N and M_k the valid (original and rolled) token counts of the global batch. ``local`` is
the objective of a per-rank rescale by ``N_r / M_k,r`` (the rank's own counts) instead, and
``tokens`` the one the fork trains since 0043, every MTP token weighted like a main token:

    J_tokens = (sum(main loss) + scale / D * sum_k sum(MTP_k loss)) / N.
"""

import inspect

import torch

HIDDEN = 4
VOCAB = 8
SEQ = 8
BATCH = 2
SCALE = 0.5


def _masks(dp_size, uneven):
    """Per-DP-rank loss masks [BATCH, SEQ]: DP rank 0 keeps most tokens, other ranks few.

    DP rank 0's second sequence ends early, so CP ranks (which hold chunks i and 2 CP - 1 - i of
    each sequence) hold different numbers of valid tokens too.
    """
    masks = []
    for r in range(dp_size):
        m = torch.ones(BATCH, SEQ)
        if uneven:
            if r == 0:
                m[1, 3:] = 0
            else:
                m[:, 2 + (r - 1) % 2 :] = 0  # two (or three) valid tokens per sequence
                m[1, 0] = 0
        masks.append(m)
    return masks


def _cp_slice(x, cp_rank, cp_size):
    """This CP rank's share of [b, s]: chunks cp_rank and 2 cp_size - 1 - cp_rank (zigzag)."""
    chunks = x.chunk(2 * cp_size, dim=-1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=-1)


def _batch(seed, rank):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, labels


def _init_params(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        'embedding': torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64),
        'mtp_proj': torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) * 0.5,
        'output': torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.5,
    }


def _hidden(tokens, embedding, mtp_proj, depth):
    """[s*(1+depth), b, h]: the main chunk and one chunk per MTP depth."""
    chunks = [embedding[tokens].transpose(0, 1)]
    for _ in range(depth):
        chunks.append(torch.tanh(chunks[-1] @ mtp_proj.t()))
    return torch.cat(chunks, dim=0)


def _rolled(x, k):
    """``roll_tensor`` with CP 1, k times: shift left, zero the tail."""
    for _ in range(k):
        x = torch.roll(x, shifts=-1, dims=-1)
        x[..., -1] = 0
    return x


def _reference(params, data, masks, depth, rule):
    """Float64 grads (name -> list) of the objective; ``rule`` 'global', 'local' or 'tokens'."""
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    n_total = sum(m.sum() for m in masks)
    total = torch.zeros((), dtype=torch.float64)
    per_rank_mtp = []
    for (tokens, labels), mask in zip(data, masks):
        hidden = _hidden(tokens, p['embedding'], p['mtp_proj'], depth)
        chunks = torch.chunk(hidden, 1 + depth, dim=0)
        logits = chunks[0] @ p['output'].t()  # [s, b, v]
        ce = torch.nn.functional.cross_entropy(
            logits.permute(1, 2, 0), labels, reduction='none'
        )  # [b, s]
        total = total + (ce * mask.double()).sum() / n_total
        terms = []
        for k in range(1, depth + 1):
            mlogits = chunks[k] @ p['output'].t()
            mce = torch.nn.functional.cross_entropy(
                mlogits.permute(1, 2, 0), _rolled(labels.clone(), k), reduction='none'
            )
            mmask = _rolled(mask.double().clone(), k)
            terms.append(((mce * mmask).sum(), mmask.sum(), mask.sum()))
        per_rank_mtp.append(terms)
    for k in range(depth):
        m_total = sum(terms[k][1] for terms in per_rank_mtp)
        for s, m, n in (terms[k] for terms in per_rank_mtp):
            if rule == 'global':
                total = total + SCALE / depth * s / m_total
            elif rule == 'tokens':
                total = total + SCALE / depth * s / n_total
            else:
                total = total + SCALE / depth * s * (n / m.clamp(min=1)) / n_total
    total.backward()
    return {k: v.grad.reshape(-1).tolist() for k, v in p.items()}


def _build(config, params):
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.multi_token_prediction import process_mtp_loss

    accepted = set(inspect.signature(process_mtp_loss).parameters)

    class TinyMTPModel(LanguageModule):
        """Embedding, one tanh projection per MTP depth, and a real ColumnParallelLinear head."""

        def __init__(self, config):
            super().__init__(config=config)
            self.model_type = __import__('megatron.core.enums', fromlist=['x']).ModelType
            self.model_type = self.model_type.encoder_or_decoder
            self.embedding = torch.nn.Parameter(params['embedding'].float().clone())
            self.mtp_proj = torch.nn.Parameter(params['mtp_proj'].float().clone())
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                HIDDEN,
                VOCAB,
                config=config,
                init_method=lambda w: None,
                bias=False,
                gather_output=False,
                skip_bias_add=False,
            )
            with torch.no_grad():
                self.output_layer.weight.copy_(params['output'].float())

        def set_input_tensor(self, input_tensor):
            pass

        def forward(self, tokens, labels, loss_mask):
            hidden = _hidden(tokens, self.embedding, self.mtp_proj, self.config.mtp_num_layers)
            kwargs = dict(
                hidden_states=hidden,
                labels=labels,
                loss_mask=loss_mask,
                output_layer=self.output_layer,
                output_weight=None,
                runtime_gather_output=None,
                is_training=self.training,
                compute_language_model_loss=self.compute_language_model_loss,
                config=self.config,
                cp_group=self.pg_collection.cp,
            )
            if 'tp_group' in accepted:
                kwargs['tp_group'] = self.tp_group
            hidden = process_mtp_loss(**kwargs)
            logits, _ = self.output_layer(hidden)
            return self.compute_language_model_loss(labels, logits)

    return TinyMTPModel(config)


def _ddp_model(ctx, depth, seed):
    """The tiny MTP model under DDP, per-token loss, its schedule hooks set as train() does.

    Returns (config, params, module, model).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from tests.scenarios.common import make_config

    config = make_config(
        hidden_size=HIDDEN,
        mtp_num_layers=depth,
        mtp_loss_scaling_factor=SCALE,
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
    )
    params = _init_params(seed)
    module = _build(config, params).to(ctx.device)
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False),
        module=module,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = None
    config.grad_scale_func = None
    config.timers = None
    return config, params, module, model


def _forward_step(data_iterator, model):
    """The schedule's forward step: the model's output and the per-token (masked) loss."""
    tok, lab, mask = next(data_iterator)
    output = model(tok, lab, mask)

    def loss_func(output_tensor):
        loss = (output_tensor.float() * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return loss, num_tokens, {'lm loss': torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


def _step(model, batches, num_microbatches):
    """One training step's forward and backward over ``batches`` (tokens, labels, mask)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=False,
    )


def _main_grads(module):
    """The main_grad of the embedding, MTP projection and output layer, as float lists."""
    grads = {
        'embedding': module.embedding.main_grad,
        'mtp_proj': module.mtp_proj.main_grad,
        'output': module.output_layer.weight.main_grad,
    }
    return {k: v.detach().double().reshape(-1).tolist() for k, v in grads.items()}


def scenario_mtp_grads(ctx, depth=1, uneven=True, seed=1, cp=1):
    """One step of DP x CP ranks, one microbatch each; the grads after ``finalize_model_grads``.

    Returns:
        dict with this rank's ``grads`` (name -> list, after finalize), the float64 ``reference``
        (global counts) and ``local`` (per-rank counts) grads, and the token counts.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from tests.scenarios.common import init_parallel

    init_parallel(cp=cp)
    MTPLossLoggingHelper.tracker = {}  # sized by the first call's depth; training cleans it
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    _, params, module, model = _ddp_model(ctx, depth, seed)

    masks = _masks(dp_size, uneven)
    data = [_batch(seed, r) for r in range(dp_size)]
    cp_rank = parallel_state.get_context_parallel_rank()
    tokens, labels, mask = (_cp_slice(x, cp_rank, cp) for x in (*data[dp_rank], masks[dp_rank]))
    _step(model, [(tokens.to(ctx.device), labels.to(ctx.device), mask.to(ctx.device))], 1)
    got = _main_grads(module)
    reference = _reference(params, data, masks, depth, 'global')
    local = _reference(params, data, masks, depth, 'local')
    tokens = _reference(params, data, masks, depth, 'tokens')

    def _diff(expected):
        return max(abs(a - b) for k in got for a, b in zip(got[k], expected[k]))

    def _norm(values):
        return sum(v * v for v in values) ** 0.5

    return {
        'grads': got,
        'reference': reference,
        'local': local,
        'diff_reference': _diff(reference),
        'diff_local': _diff(local),
        'diff_tokens': _diff(tokens),
        'mtp_proj_norm': _norm(got['mtp_proj']),
        'mtp_proj_norm_reference': _norm(reference['mtp_proj']),
        'mtp_proj_norm_local': _norm(local['mtp_proj']),
        'mtp_proj_norm_tokens': _norm(tokens['mtp_proj']),
        'counts': [
            [float(m.sum()), [float(_rolled(m.clone(), k).sum()) for k in range(1, depth + 1)]]
            for m in masks
        ],
        'dp_size': dp_size,
        'local_tokens': float(mask.sum()),
    }
