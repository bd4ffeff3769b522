"""Issue 39 item 3: the router gradient of the load-balancing losses at DP > 1, with several
microbatches and uneven valid tokens, against float64 gradients computed from the definition.

The tree's ``TopKRouter`` runs alone (a module whose output is the router's probs) through the
real no-pipelining schedule, megatron DDP and ``finalize_model_grads``, on DP (x TP) CPU ranks;
the main loss is 0, so the router weight's gradient is the load-balancing loss's alone. The
reference is computed in one process with no megatron code, from the definition (Switch /
GShard, the global-batch form of Qwen's "global-batch load balancing"), TP = CP = 1 semantics
(TP shards the sequence, sequence parallel):

    U_m = every DP rank's m-th microbatch (valid tokens only), T_m = |U_m|, N = sum_m T_m
    C_m[i] = tokens of U_m routed to expert i (top-k), K = top-k, E = experts
    f^(m) = sum_{k<=m} C_k / (K sum_{k<=m} T_k)   (the running estimate over the step so far)
    P^(m) = sum_{x in U_m} s(x) / T_m
    L_m = E * sum_i f^(m)_i P^(m)_i
    mean loss:  J = coeff * (1/M) sum_m L_m
    per-token:  J = coeff * sum_m (T_m / N) L_m   (every token weighs 1/N, as in the main loss)

``aux_loss`` (the control): L_{r,m} with f and P over rank r's microbatch m alone;
mean: J = coeff / (DP M) sum L_{r,m}; per-token: J = coeff * sum (T_{r,m} / N) L_{r,m}.

The ``upstream-*`` variants of the reference model what upstream computes (the tests pin the
pristine arm to them): f normalised by the current microbatch's count only, and each rank's
share of the global loss averaged over DP instead of summed.

The definition's helpers (:func:`scores_and_routing`, :func:`running_fractions`,
:func:`loss_share`, :func:`objective_weight`) are also the MoE oracle's global aux loss
(tests/scenarios/moe_oracle.py, a whole GPT's routers in every parallel layout).
"""

import torch

HIDDEN = 8
EXPERTS = 4
TOPK = 2
SEQ = 8
BSZ = 2
M = 2
DP = 2
COEFF = 0.1
SEED = 7213
# valid tokens of (dp_rank, microbatch) out of SEQ * BSZ = 16
PATTERNS = {
    'uneven': {(0, 0): 16, (0, 1): 6, (1, 0): 10, (1, 1): 13},
    'even': {(0, 0): 12, (0, 1): 12, (1, 0): 12, (1, 1): 12},
    'skewdp': {(0, 0): 14, (0, 1): 14, (1, 0): 6, (1, 1): 6},  # even over m, uneven over DP
    'none': None,
}


def _data(r, m, pattern):
    gen = torch.Generator().manual_seed(SEED + 10 * r + m)
    x = torch.randn(SEQ, BSZ, HIDDEN, generator=gen, dtype=torch.float64)
    if PATTERNS[pattern] is None:
        return x, None
    mask = torch.zeros(SEQ, BSZ, dtype=torch.bool)  # True = padding
    mask.view(-1)[PATTERNS[pattern][r, m] :] = True
    return x, mask


def _weight():
    gen = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(EXPERTS, HIDDEN, generator=gen, dtype=torch.float64) * 0.7


# ------------------------------------------------------------------------------------------
# The definition (float64 here; tests/scenarios/moe_oracle.py feeds it a GPT's routers too).


def scores_and_routing(logits, topk, score_function='softmax'):
    """The scores [T, E] that the load-balancing losses average (the router's score function;
    sigmoid scores normalized over the experts; no expert bias) and the top-k routing map
    [T, E] of those scores (a constant) that they count, for the logits [T, E] of some tokens."""
    if score_function == 'softmax':
        scores = torch.softmax(logits, dim=-1)
    else:
        assert score_function == 'sigmoid', score_function
        scores = torch.sigmoid(logits)
        scores = scores / scores.sum(dim=-1, keepdim=True)
    idx = torch.topk(scores.detach(), topk, dim=-1).indices
    return scores, torch.zeros_like(scores.detach()).scatter(1, idx, 1.0)


def running_fractions(counts, tokens, topk):
    """The definition's f^(m) for m = 0, 1, ...: ``counts[m]`` = C_m (the tokens per expert of
    U_m, every DP rank's m-th microbatch; no gradient) and ``tokens[m]`` = T_m (its valid
    tokens): f^(m) = sum_{k<=m} C_k / (topk * sum_{k<=m} T_k)."""
    return [sum(counts[: m + 1]) / (topk * sum(tokens[: m + 1])) for m in range(len(counts))]


def loss_share(f, scores, total_tokens):
    """The part of L_m = E * sum_i f_i P_i that ``scores`` [T, E] (some of U_m's valid tokens, a
    DP rank's microbatch m) hold, P over ``total_tokens`` = T_m: U_m's parts add up to L_m."""
    return scores.shape[-1] * (f * scores.sum(0)).sum() / total_tokens


def objective_weight(per_token, total_tokens, step_tokens, microbatches):
    """The weight of L_m in the step's objective (times the coefficient): 1 / M under the mean
    loss; under per-token loss T_m / N (``total_tokens`` over the step's tokens ``step_tokens``:
    every token weighs 1 / N, as in the main loss)."""
    return total_tokens / step_tokens if per_token else 1.0 / microbatches


# ------------------------------------------------------------------------------------------
# Reference from the definition (float64, one process, no megatron code).


def _scores(w, x, mask):
    """Valid tokens' softmax scores [T, E] and top-k routing map [T, E] (router token order)."""
    flat = x.reshape(-1, HIDDEN)
    if mask is not None:
        flat = flat[~mask.reshape(-1)]
    return scores_and_routing(flat @ w.t(), TOPK)


def reference(loss, per_token, pattern, variant='prefix'):
    """Grad of the definition's objective. variant: 'prefix' (f over microbatches 1..m, the
    causal running estimate upstream intends), 'step' (f over the whole step: the textbook
    global-batch f, not reachable in one pass), plus the 'upstream-*' models of what upstream
    computes (to confirm the mechanism)."""
    w = _weight().clone().requires_grad_(True)
    per = {(r, m): _scores(w, *_data(r, m, pattern)) for r in range(DP) for m in range(M)}
    T = {k: float(s.shape[0]) for k, (s, _) in per.items()}
    N = sum(T.values())
    J = 0.0
    if loss == 'aux_loss':
        for (r, m), (s, rmap) in per.items():
            L = loss_share(rmap.sum(0) / (TOPK * T[r, m]), s, T[r, m])
            J = J + COEFF * (T[r, m] / N if per_token else 1.0 / (DP * M)) * L
    else:
        Tm = [sum(T[r, m] for r in range(DP)) for m in range(M)]
        Cm = [sum(per[r, m][1].sum(0) for r in range(DP)) for m in range(M)]
        prefix = running_fractions(Cm, Tm, TOPK)
        for m in range(M):
            if variant == 'step':
                f = sum(Cm) / (TOPK * sum(Tm))
            elif variant.startswith('upstream'):
                f = (sum(Cm[: m + 1]) / (m + 1)) / (TOPK * Tm[m])
            else:
                f = prefix[m]
            for r in range(DP):
                Lr = loss_share(f, per[r, m][0], Tm[m])  # rank r's part of L_m
                if variant == 'upstream-mean':  # DDP mean of per-rank losses: 1/(DP M)
                    wgt = 1.0 / (DP * M)
                elif variant == 'upstream-pt-global':  # rescale by T_m (pristine, mask)
                    wgt = Tm[m] / N
                elif variant == 'upstream-pt-local':  # rescale by T_{r,m} (0034, or no mask)
                    wgt = T[r, m] / N
                else:
                    wgt = objective_weight(per_token, Tm[m], N, M)
                J = J + COEFF * wgt * Lr
    J.backward()
    return w.grad.flatten().tolist()


def reference_values(pattern):
    """The definition's L_m (no coefficient) of each microbatch m: the global loss's value."""
    w = _weight()
    per = {(r, m): _scores(w, *_data(r, m, pattern)) for r in range(DP) for m in range(M)}
    scores = [torch.cat([per[r, m][0] for r in range(DP)]) for m in range(M)]
    counts = [torch.cat([per[r, m][1] for r in range(DP)]).sum(0) for m in range(M)]
    tokens = [float(s.shape[0]) for s in scores]
    fractions = running_fractions(counts, tokens, TOPK)
    return [float(loss_share(f, s, t)) for f, s, t in zip(fractions, scores, tokens)]


# ------------------------------------------------------------------------------------------
# The parallel run (the tree under test), a world of DP = 2 CPU ranks.


class _RouterModule(torch.nn.Module):
    def __init__(self, config):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.router import TopKRouter

        super().__init__()
        self.router = TopKRouter(
            config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )

    def set_input_tensor(self, tensor):
        pass

    @property
    def model_type(self):
        from megatron.core.enums import ModelType

        return ModelType.encoder_or_decoder

    def forward(self, x, padding_mask):
        kwargs = {} if padding_mask is None else {'padding_mask': padding_mask}
        return self.router(x, **kwargs)


def _run(case):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = case.get('tp', 1)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        dtype = torch.float64
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_router_dtype='fp64',
            moe_router_load_balancing_type=case['loss'],
            moe_aux_loss_coeff=COEFF,
            calculate_per_token_loss=case['per_token'],
            tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1,
            add_bias_linear=False,
            use_cpu_initialization=True,
        )
        module = _RouterModule(config)
        with torch.no_grad():
            module.router.weight.copy_(_weight())
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), module
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        config.grad_sync_func = None
        config.param_sync_func = None
        config.grad_scale_func = None
        config.timers = None
        r = ps.get_data_parallel_rank()
        t = ps.get_tensor_model_parallel_rank()
        chunk = SEQ // tp
        batches = []
        for m in range(M):
            x, mask = _data(r, m, case['pattern'])
            # the replica's (whole microbatch's) valid tokens: what its loss_func counts
            valid = SEQ * BSZ if mask is None else int((~mask).sum())
            x = x[t * chunk : (t + 1) * chunk].contiguous()
            mask = None if mask is None else mask[t * chunk : (t + 1) * chunk].contiguous()
            batches.append((x, mask, valid))

        def forward_step(data_iterator, model):
            x, mask, valid = next(data_iterator)
            probs, _ = model(x, mask)

            def loss_func(out):
                loss = 0.0 * out.sum()
                return loss, torch.tensor(valid, dtype=torch.int), {'lm loss': loss.detach()}

            return probs, loss_func

        router = module.router
        logged = []  # per step and microbatch: the global aux loss as handed to the logging
        attach = router.attach_and_log_load_balancing_loss

        def recording_attach(activation, coeff, aux_loss, name, *a, **kw):
            if name == 'global_load_balancing_loss':
                logged[-1].append(float(aux_loss.detach()) / coeff)
            return attach(activation, coeff, aux_loss, name, *a, **kw)

        router.attach_and_log_load_balancing_loss = recording_attach
        for _ in range(case.get('steps', 1)):  # finalize_model_grads resets the tracker
            logged.append([])
            model.zero_grad_buffer()
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[model],
                num_microbatches=M,
                seq_length=SEQ,
                micro_batch_size=BSZ,
                forward_only=False,
            )
        return {
            'grad': router.weight.main_grad.detach().double().flatten().tolist(),
            'logged': logged,
        }
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
        ps.destroy_model_parallel()


def scenario_global_aux(ctx, cases):
    from tests.scenarios.common import each_case
    from tests.scenarios.moe_oracle import _cpu_stand_ins

    with _cpu_stand_ins():
        return {'cases': each_case(cases, _run)}
