"""Warmup scenarios in pipeline-parallel and expert-parallel layouts (patch 0004, issue 14).

Each model chunk is one (virtual) pipeline stage of a tiny MLP that the real schedules drive: the
first stage reads ``x`` from its batch, the middle stages read the activation that
``set_input_tensor`` hands them, and the last stage reads ``y`` and returns the loss. Every stage
has an expert block (params with ``allreduce = False``), so DDP has expert bucket groups and the
optimizer is a ChainedOptimizer with an expert sub-optimizer; with EP 2 each rank's expert block
is its own (expert DP 1), as in a MoE layer. With ``moe=True`` the expert block is upstream's own
MoELayer (router with sigmoid scores and an aux-loss-free expert bias that finalize_model_grads
updates, allgather token dispatcher, one local expert per EP rank).

Real steps go through megatron.training.training.train_step with train()'s set-up
(install_train_loop_hooks), the pipeline schedule from get_forward_backward_func() and per-chunk
data iterators (first and last stage only; middle stages get None, as in pretrain()).
"""

import contextlib
import hashlib
import io
import random
import types

import numpy as np
import torch

from tests.scenarios import warmup as W
from tests.scenarios.common import (
    build_optimizer,
    init_parallel,
    install_train_loop_hooks,
    make_config,
    patched,
)

MBS = W.MBS
HIDDEN = 8
OUT = 4


def _live_state(state):
    """Optimizer state of one param; Adam's fresh state (zero moments, step 0), which the warmup
    keeps allocated, reads as absent."""
    if all(isinstance(v, torch.Tensor) and not v.any() for v in state.values()):
        return {}
    return state


def _moe_layer(config):
    """Upstream's MoELayer from the local GPT layer spec (its MoE entry is a partial on 0.18.2,
    0.19.2 and dev)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return spec.submodules.mlp(config=config)


def _moe_fields(ep, experts=None):
    """TransformerConfig fields of the MoE stage model: ``experts`` (default ``ep``) experts,
    top-1, expert bias."""
    return dict(
        num_moe_experts=experts or ep,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_token_dispatcher_type='allgather',
        moe_router_load_balancing_type='none',
        moe_router_score_function='sigmoid',
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-2,
        expert_model_parallel_size=ep,
        add_bias_linear=False,
        ffn_hidden_size=HIDDEN,
        hidden_size=HIDDEN,
        use_cpu_initialization=True,
    )


def _stage_model(config, first, last, seed, vp_stage):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class StageModel(MegatronModule):
        """One pipeline stage: what schedules.py and finalize_model_grads read on a chunk."""

        def __init__(self):
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.pg_collection = None
            self.pre_process, self.post_process = first, last
            self.vp_stage = vp_stage  # Float16Module casts the input on virtual stage 0 only
            self.share_embeddings_and_output_weights = False
            self.input_tensor = None
            self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
            if config.num_moe_experts:
                self.moe = _moe_layer(config)
            else:
                self.expert = torch.nn.Linear(HIDDEN, HIDDEN)
                for p in self.expert.parameters():
                    p.allreduce = False
            self.head = torch.nn.Linear(HIDDEN, OUT) if last else None

        def set_input_tensor(self, input_tensor):
            if isinstance(input_tensor, list):
                input_tensor = input_tensor[0]
            self.input_tensor = input_tensor

        def forward(self, x):
            h = x.unsqueeze(0) if self.pre_process else self.input_tensor  # [seq 1, mbs, hidden]
            h = torch.tanh(self.fc(h))
            h = h + (self.moe(h)[0] if config.num_moe_experts else torch.tanh(self.expert(h)))
            return self.head(h[0]) if self.post_process else h

    torch.manual_seed(seed)
    return StageModel()


def _core(chunk):
    while not hasattr(chunk, 'post_process'):
        chunk = chunk.module
    return chunk


def _forward_step(data_iterator, model):
    """Reads a batch where the stage has an iterator; draws python, numpy and torch RNG."""
    core = _core(model)
    x, y = W._xy(next(data_iterator), HIDDEN, OUT) if data_iterator is not None else (None, None)
    device = next(core.parameters()).device
    x, y = (None, None) if x is None else (x.to(device), y.to(device))
    noise = torch.randn(MBS, HIDDEN) * 1e-2 + (random.random() - 0.5) * 1e-3
    noise = noise + float(np.random.rand()) * 1e-3
    if x is not None:
        x = x + noise.to(x.device)
    output = model(x)
    if not core.post_process:
        return output, lambda out: out
    return output, lambda out: W._loss_func(y, out)


def _batches(seed, device, dp_rank, count=None):
    g = torch.Generator().manual_seed(seed + dp_rank)
    n = 0
    while count is None or n < count:
        n += 1
        yield torch.randn(MBS, HIDDEN, generator=g).to(device), torch.randn(
            MBS, OUT, generator=g
        ).to(device)


class PPTrainer:
    """Model chunks (one per virtual stage) in DDP, optimizer, scheduler and global args."""

    def __init__(
        self,
        ctx,
        dtype,
        overlap,
        distopt,
        acc,
        vpp=1,
        opg=False,
        opt_kwargs=None,
        moe=False,
        experts=None,
        bucket_size=40,
    ):
        from megatron.core import parallel_state as ps
        from megatron.core import rerun_state_machine
        from megatron.core.distributed import DistributedDataParallelConfig

        rerun_state_machine.destroy_rerun_state_machine()
        rerun_state_machine.initialize_rerun_state_machine()
        self.ctx, self.acc, self.vpp = ctx, acc, vpp
        pp, rank = (
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
        )
        self.config = make_config(
            dtype,
            num_layers=pp * vpp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            **(_moe_fields(ps.get_expert_model_parallel_world_size(), experts) if moe else {}),
        )
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=distopt,
            bucket_size=bucket_size,
            overlap_param_gather=opg,
        )
        self.model = self._chunks(ctx, dtype, ddp_config, pp, rank)
        self.optimizer = build_optimizer(
            self.model, dtype=dtype, distopt=distopt, **(opt_kwargs or {})
        )
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.config.grad_scale_func = None
        self.config.no_sync_func = self.config.finalize_model_grads_func = None
        self.config.timers = None
        self.scheduler = W._scheduler(self)
        shim = types.SimpleNamespace(model=self.model[0], dp_size=self.dp_size, ctx=ctx)
        self.args = W._set_global_args(shim, acc, opg)
        self.args.pipeline_model_parallel_size = pp
        self.args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
        self.args.expert_model_parallel_size = ps.get_expert_model_parallel_world_size()

    def _chunks(self, ctx, dtype, ddp_config, pp, rank):
        """One DDP-wrapped model chunk per virtual stage on this rank (fp16/bf16: Float16Module)."""
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.transformer.module import Float16Module

        model = []
        for i in range(self.vpp):
            stage = i * pp + rank  # virtual stage of chunk i
            first, last = stage == 0, stage == pp * self.vpp - 1
            chunk = _stage_model(self.config, first, last, 1234 + 101 * stage, i).to(ctx.device)
            if dtype != 'fp32':
                chunk = Float16Module(self.config, chunk)
            model.append(
                DistributedDataParallel(
                    config=self.config,
                    ddp_config=ddp_config,
                    module=chunk,
                    disable_bucketing=i > 0,  # as get_model()
                )
            )
        return model

    def iterators(self, make):
        """Per-chunk iterators as pretrain() builds them: first and last stage only (the warmup
        builds its own in run_warmup, which a pristine tree lacks)."""
        from megatron.core import parallel_state as ps

        pp, rank = (
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
        )
        its = [
            make() if (rank, i) in ((0, 0), (pp - 1, self.vpp - 1)) else None
            for i in range(self.vpp)
        ]
        return its if self.vpp > 1 else its[0]

    def digests(self):
        """Bitwise digests of this rank's state (params, optimizer per sub-optimizer, ...)."""
        out = {}
        h = hashlib.sha256()
        for chunk in self.model:
            for _, p in chunk.named_parameters():
                W._sha(h, p)
        out['params'] = h.hexdigest()[:16]
        self._optimizer_digests(out)
        out['scheduler'] = repr(sorted(self.scheduler.state_dict().items()))
        h = hashlib.sha256()
        W._sha(h, torch.get_rng_state())
        h.update(repr(random.getstate()).encode())
        h.update(np.random.get_state()[1].tobytes())
        out['rng'] = h.hexdigest()[:16]
        args = self.args
        out['counters'] = [args.iteration, args.consumed_train_samples]
        self._buffer_digests(out)
        return out

    def _optimizer_digests(self, out):
        """Per sub-optimizer: a digest of its groups, params and live state; its state entries."""
        for index, opt in enumerate(W._optimizers(self.optimizer)):
            h = hashlib.sha256()
            inner = opt.optimizer
            for group in inner.param_groups:
                h.update(repr(sorted((k, v) for k, v in group.items() if k != 'params')).encode())
                for p in group['params']:
                    W._sha(h, p)
                    for key, value in sorted(_live_state(inner.state.get(p, {})).items()):
                        h.update(key.encode())
                        (
                            W._sha(h, value)
                            if isinstance(value, torch.Tensor)
                            else h.update(repr(value).encode())
                        )
            out[f'optimizer{index}'] = h.hexdigest()[:16]
        out['optimizer_state_entries'] = [
            sum(bool(_live_state(state)) for state in o.optimizer.state.values())
            for o in W._optimizers(self.optimizer)
        ]

    def _buffer_digests(self, out):
        """Digests of the grad buffers and module buffers, the expert bias, DDP calibration."""
        h = hashlib.sha256()
        for chunk in self.model:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                W._sha(h, buffer.grad_data)
        out['grad_buffers'] = h.hexdigest()[:16]
        h = hashlib.sha256()  # module buffers: the MoE router's expert bias and token counts
        for chunk in self.model:
            for _, buffer in torch.nn.Module.named_buffers(chunk):
                W._sha(h, buffer)
        out['module_buffers'] = h.hexdigest()[:16]
        biases = [
            b
            for chunk in self.model
            for name, b in torch.nn.Module.named_buffers(chunk)
            if name.endswith('expert_bias')
        ]
        if biases:  # finalize_model_grads moves it after every step
            out['expert_bias_nonzero'] = [bool(b.any()) for b in biases]
        out['calibration'] = [
            [group.is_first_batch, len(group.golden_per_param_grad_ready_counts)]
            for chunk in self.model
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
        ]
        out['n_expert_bucket_groups'] = sum(
            len(c.expert_parallel_bucket_groups) for c in self.model
        )

    def real_steps(self, steps, first_step=0, warmup=None):
        """train()'s set-up, then ``warmup(param_sync_func)`` where train() calls run_warmup()
        (if given), then ``steps`` real train_step calls; returns this rank's losses."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.training import training

        param_sync_func = install_train_loop_hooks(
            self.model, self.optimizer, self.config, self.args
        )
        pending = training.should_disable_forward_pre_hook(self.args)
        if warmup is not None:
            warmup(param_sync_func)
        losses = []
        for step in range(first_step, first_step + steps):
            data = self.iterators(
                lambda: _batches(10_000 + 97 * step, self.ctx.device, self.dp_rank, self.acc)
            )
            with contextlib.redirect_stdout(io.StringIO()):
                out = training.train_step(
                    _forward_step,
                    data,
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    self.config,
                    get_forward_backward_func(),
                    iteration=self.args.iteration,
                )
            if pending and not out[1]:
                training.enable_forward_pre_hook(self.model)
                self.config.param_sync_func = param_sync_func
                pending = False
            self.args.iteration += 1
            self.args.consumed_train_samples += MBS * self.dp_size * self.acc
            losses.append(float(out[0]['loss']) if 'loss' in out[0] else None)
        return losses

    def warmup(self, steps, param_sync_func):
        """run_warmup() as train() calls it (its synthetic GPT batches, on the stages that read
        batches), with train_step wrapped to record which chunks got a data iterator."""
        from megatron.training import training
        from megatron.training.warmup import run_warmup

        def step(*a, **kw):
            data = a[1] if isinstance(a[1], list) else [a[1]]
            self.stages_with_batches = [i for i, it in enumerate(data) if it is not None]
            return training.train_step(*a, **kw)

        with contextlib.redirect_stdout(io.StringIO()):
            return run_warmup(
                step,
                _forward_step,
                self.model,
                self.optimizer,
                self.scheduler,
                self.config,
                param_sync_func,
                steps,
                args=self.args,
            )


def _layout(ctx, pp, ep, vpp):
    from megatron.core import parallel_state as ps

    W._import_training()
    ps.destroy_model_parallel()
    init_parallel(pp=pp, ep=ep, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    return {
        'pp': ps.get_pipeline_model_parallel_world_size(),
        'pp_rank': ps.get_pipeline_model_parallel_rank(),
        'dp': ps.get_data_parallel_world_size(),
        'ep': ps.get_expert_model_parallel_world_size(),
        'expert_dp': ps.get_expert_data_parallel_world_size(),
    }


@W._device_rng
def scenario_exactness(ctx, combos, warmup_steps=2, real_steps=3):
    """Per combo: real steps after warmup+restore vs without warmup, bitwise, on every rank."""
    results = []
    for combo in combos:
        pp, ep, vpp = combo.get('pp', 1), combo.get('ep', 1), combo.get('vpp', 1)
        arms = {}
        for arm in ('none', 'fork'):
            layout = _layout(ctx, pp, ep, vpp)
            t = PPTrainer(
                ctx,
                combo['dtype'],
                combo['overlap'],
                combo['distopt'],
                combo['acc'],
                vpp,
                moe=combo.get('moe', False),
            )
            W._seed_all()
            res = {'layout': layout}
            if combo.get('resume'):
                t.real_steps(combo['resume'])
                for name in W._CONFIG_CALLBACKS:  # leave train() as a resumed run starts
                    setattr(t.config, name, None)
                for chunk in t.model:
                    chunk.zero_grad_buffer()
                res['resumed_state_entries'] = t.digests()['optimizer_state_entries']
            before = t.digests()
            warmup = None
            if arm == 'fork':

                def warmup(param_sync_func, t=t, res=res, before=before):
                    report = t.warmup(warmup_steps, param_sync_func)
                    after = t.digests()
                    res['after_warmup_diff'] = [k for k in before if before[k] != after[k]]
                    res['groups_reset'] = report.bucket_groups_reset
                    res['calibration_kept'] = report.calibration_kept
                    res['stages_with_batches'] = t.stages_with_batches
                    res['warmup_losses'] = [float(x['loss']) if x else None for x in report.losses]

            res['losses'] = t.real_steps(real_steps, combo.get('resume', 0), warmup)
            res['final'] = t.digests()
            arms[arm] = res
        none, fork = arms['none'], arms['fork']
        results.append(
            {
                'combo': combo,
                'layout': fork['layout'],
                'losses_none': none['losses'],
                'losses_fork': fork['losses'],
                'diff_keys': [k for k in none['final'] if none['final'][k] != fork['final'][k]],
                'final': fork['final'],
                'fork': {k: v for k, v in fork.items() if k not in ('final', 'layout')},
            }
        )
    return {'results': results}


@W._device_rng
def scenario_naive(ctx, pp, acc, finalize, ep=1, warmup_steps=2, real_steps=3):
    """A naive warmup (train_step before train()'s set-up, no restore), then real steps."""
    out = {'layout': _layout(ctx, pp, ep, 1)}
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training import training

    arms = {}
    for arm in ('none', 'naive'):
        _layout(ctx, pp, ep, 1)
        t = PPTrainer(ctx, 'bf16', True, True, acc)
        W._seed_all()
        try:
            if arm == 'naive':
                t.config.finalize_model_grads_func = finalize_model_grads if finalize else None
                data = t.iterators(lambda: _batches(777, ctx.device, 0))
                with contextlib.redirect_stdout(io.StringIO()):
                    for _ in range(warmup_steps):
                        training.train_step(
                            _forward_step,
                            data,
                            t.model,
                            t.optimizer,
                            t.scheduler,
                            t.config,
                            get_forward_backward_func(),
                            iteration=0,
                        )
                t.config.finalize_model_grads_func = None
            arms[arm] = {'losses': t.real_steps(real_steps), 'error': None}
        except Exception as exc:  # noqa: BLE001 - the upstream assertion is the expected outcome
            arms[arm] = {'losses': None, 'error': f'{type(exc).__name__}: {exc}'}
    out['none'], out['naive'] = arms['none'], arms['naive']
    return out


class _Injected(RuntimeError):
    pass


@W._device_rng
def scenario_fault(ctx, pp, fail_rank, warmup_steps=3, fail_step=2, acc=2):
    """A warmup step raises on one rank (one stage) only, after its schedule ran: every rank
    restores its state and raises (the failing rank its own error, the others WarmupPeerError);
    real steps afterwards are bitwise equal to a run without warmup."""
    W._import_training()
    from megatron.training.warmup import WarmupPeerError

    results = {}
    for arm in ('none', 'fault'):
        _layout(ctx, pp, 1, 1)
        t = PPTrainer(ctx, 'bf16', True, True, acc, opg=True)
        W._seed_all()
        before = t.digests()
        res = {}
        if arm == 'fault':
            scheduler_step, calls = t.scheduler.step, {'n': 0}

            def failing_step(*a, **k):
                calls['n'] += 1
                if ctx.rank == fail_rank and calls['n'] == fail_step:
                    raise _Injected(f'injected failure on rank {ctx.rank}')
                return scheduler_step(*a, **k)

            def warmup(param_sync_func):
                callbacks = {n: getattr(t.config, n) for n in W._CONFIG_CALLBACKS}
                hooks = [len(c.remove_forward_pre_hook_handles) > 0 for c in t.model]
                t.scheduler.step = failing_step
                try:
                    t.warmup(warmup_steps, param_sync_func)
                    res['raised'] = None
                except (_Injected, WarmupPeerError) as exc:
                    res['raised'] = f'{type(exc).__name__}: {exc}'
                del t.scheduler.step
                res['steps_started'] = calls['n']
                after = t.digests()
                res['state_diff'] = [k for k in before if before[k] != after[k]]
                res['callbacks_restored'] = all(
                    getattr(t.config, n) is v for n, v in callbacks.items()
                )
                # As install_train_loop_hooks() left them: disabled for the first real step.
                now = [len(c.remove_forward_pre_hook_handles) > 0 for c in t.model]
                res['hooks_restored'] = now == hooks and not any(hooks)

        res['losses'] = t.real_steps(3, warmup=warmup if arm == 'fault' else None)
        res['final'] = t.digests()
        results[arm] = res
    return W._fault_against_none(results)


def _skip_empty_experts(experts):
    """Make a SequentialMLP run only the experts that got tokens (a subclass, as a custom experts
    layer may be): an expert that got none takes no part in the graph, so its params register no
    grad in that step."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class SkippingSequentialMLP(SequentialMLP):
        def forward(self, hidden, tokens_per_expert, probs):
            counts = tokens_per_expert.tolist()
            outputs = []
            for expert, tokens, p in zip(
                self.local_experts, hidden.split(counts), probs.split(counts)
            ):
                outputs.append(expert(tokens, p)[0] if tokens.shape[0] else tokens)
            return torch.cat(outputs), None

    experts.__class__ = SkippingSequentialMLP


@W._device_rng
def scenario_moe_zero_tokens(ctx, skip_empty=False, keep_all=False, warmup_steps=2, real_steps=3):
    """Upstream's MoELayer with 2 experts on this rank (EP 1, top-1 sigmoid router with an expert
    bias, allgather dispatcher), fp32, DDP with overlap_grad_reduce, one param per bucket group.
    The router's expert bias sends every token to expert 1 up to where train() calls the warmup
    (so the warmup's synthetic batches reach expert 1 only), and every real token to expert 0
    from there on, so expert 1 gets none in every real step.

    Arms 'none' (no warmup) and 'fork' (the warmup where train() calls it). ``skip_empty``: the
    experts layer skips an expert without tokens (a SequentialMLP subclass). ``keep_all``: the
    warmup keeps its calibration on every bucket group, as if no router could withhold a grad
    (warmup._routed_params returns nothing).
    """
    W._import_training()
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training import warmup as warmup_module

    results = {}
    for arm in ('none', 'fork'):
        _layout(ctx, 1, 1, 1)
        t = PPTrainer(ctx, 'fp32', True, False, 1, moe=True, experts=2, bucket_size=1)
        layers = [m for chunk in t.model for m in chunk.modules() if isinstance(m, MoELayer)]
        tokens = {'phase': 'warmup', 'warmup': [], 'real': []}
        for layer in layers:
            if skip_empty:
                _skip_empty_experts(layer.experts)
            layer.experts.register_forward_pre_hook(
                lambda m, a: tokens[tokens['phase']].append(a[1].tolist())
            )
            layer.router.expert_bias[0] = -1e3
        W._seed_all()
        res = {'error': None, 'experts_type': type(layers[0].experts).__name__}

        def warmup(param_sync_func, t=t, res=res, arm=arm, tokens=tokens, layers=layers):
            if arm == 'fork':
                routed = patched(warmup_module, '_routed_params', lambda model, config: set())
                with routed if keep_all else contextlib.nullcontext():
                    report = t.warmup(warmup_steps, param_sync_func)
                res['groups_reset'] = report.bucket_groups_reset
                res['calibration_kept'] = report.calibration_kept
            tokens['phase'] = 'real'
            for layer in layers:  # expert 1 never wins the top-1 from here on
                layer.router.expert_bias[0], layer.router.expert_bias[1] = 0.0, -1e3

        try:
            res['losses'] = t.real_steps(real_steps, warmup=warmup)
        except Exception as exc:  # noqa: BLE001 - the DDP assertion is the expected outcome
            res['error'] = f'{type(exc).__name__}: {exc}'.splitlines()[0]
        res['tokens'] = {k: tokens[k] for k in ('warmup', 'real')}
        res['final'] = t.digests() if res['error'] is None else None
        results[arm] = res
    none, fork = results['none'], results['fork']
    fork['identical_to_no_warmup'] = fork['error'] is None and fork['final'] == none['final']
    fork['identical_to_no_warmup'] = fork['identical_to_no_warmup'] and (
        fork['losses'] == none['losses']
    )
    return {'none': {k: v for k, v in none.items() if k != 'final'}, 'fork': fork}
