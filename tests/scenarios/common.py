"""Reusable builders for scenarios: a tiny model, DDP + optimizer, data, and a training loop.

Everything here runs inside a harness world (see tests/harness/README.md). What train() installs
on the model config before its loop comes from one place, megatron/training/training.py's
``install_train_loop_hooks()`` (see :func:`install_train_loop_hooks`). :class:`Trainer` also lets a
scenario set single hooks by hand (e.g. a warm-up step run before ``train()`` would have installed
them); those are the scenario's deliberate deviations, not train()'s set-up.
"""

import contextlib
import copy
import glob
import hashlib
import os
import sys
import types
from functools import partial

import torch
import torch.distributed as dist

HIDDEN = 8
FFN = 16
OUT = 4
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}


class TrainLoopArgs(types.SimpleNamespace):
    """Megatron args where a flag that was not given reads as off (None), as the store_true and
    optional flags of pretrain()'s parser default."""

    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)
        return None


def train_loop_args(**overrides):
    """The Megatron args that install_train_loop_hooks() and the warmup read, at pretrain()'s
    defaults for a DDP run with overlap_grad_reduce (every other flag off); ``overrides`` replace
    single values."""
    on = {'overlap_grad_reduce': True, 'align_grad_reduce': True}
    return TrainLoopArgs(**on, pipeline_model_parallel_size=1, iteration=0, **overrides)


def install_train_loop_hooks(model, optimizer, config, args):
    """What train() installs before its loop: ``training.install_train_loop_hooks()``.

    A pristine tree lacks that function (it is the fork's refactor of train()); there the same
    function, read from this base's patch, is compiled against pristine's own training module, so
    a counterfactual runs exactly the set-up train() runs, with pristine's DDP and finalize.

    Args:
        model: list of model chunks.
        optimizer: the Megatron optimizer.
        config: the model config.
        args: Megatron global args.

    Returns:
        The param_sync_func to put back when the forward pre-hooks are enabled after step 1.
    """
    from megatron.training import training

    if not hasattr(training, 'install_train_loop_hooks'):
        from tests.harness import bases

        for path in sorted(glob.glob(os.path.join(bases.PATCHES, bases.BASE, 'fork', '*.patch'))):
            with open(path) as f:
                lines = f.read().splitlines()
            starts = [
                i for i, line in enumerate(lines) if line.startswith('+def install_train_loop')
            ]
            if starts and not hasattr(training, 'install_train_loop_hooks'):
                body = lines[starts[0] :]
                body = body[: next(i for i, line in enumerate(body) if not line.startswith('+'))]
                namespace = dict(vars(training))
                exec('\n'.join(line[1:] for line in body), namespace)  # noqa: S102
                training.install_train_loop_hooks = namespace['install_train_loop_hooks']
    return training.install_train_loop_hooks(model, optimizer, config, args)


def import_with_real_cuda(module):
    """Import ``module`` (e.g. 'megatron.training.training') with the real ``torch.cuda`` bound.

    A few modules megatron.training pulls in (e.g. the nvshmem resharding service) touch
    torch.cuda attributes at import time only; the CPU redirect would reject those. No CUDA work
    happens here.
    """
    import importlib

    if module in sys.modules:
        return
    try:
        from tests.harness import cpu_redirect
    except ImportError:
        cpu_redirect = None
    if cpu_redirect is None or not cpu_redirect.installed():
        importlib.import_module(module)
        return
    proxy = torch.cuda
    torch.cuda = cpu_redirect._REAL_CUDA
    try:
        importlib.import_module(module)
    finally:
        torch.cuda = proxy


@contextlib.contextmanager
def patched(owner, name, value):
    """Set ``owner.name = value`` for the duration of the block, then put the old value back."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def torch_norm_sequence_parallel():
    """The local spec's torch LayerNorm (``WrappedTorchNorm``) under sequence parallelism, for
    the whole block: it refuses SP, so it is built without it and its params get the
    ``sequence_parallel`` mark that apex's FusedLayerNorm (the local spec's norm where apex is
    installed) gives them, so that finalize_model_grads sums their grads over TP."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            setattr(param, 'sequence_parallel', sequence_parallel)
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)
    try:
        yield
    finally:
        WrappedTorchNorm.__new__ = original


def each_case(cases, run):
    """``[{'name': ..., **run(case)}]`` per case; a case that raises reports ``'error'`` (its
    traceback on stderr, the rank log) and the next one still runs."""
    out = []
    for case in cases:
        res = {'name': case['name']}
        try:
            res.update(run(case))
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            res['error'] = f'{type(exc).__name__}: {exc}'[:400]
        out.append(res)
    return out


def init_parallel(tp=1, pp=1, ep=1, etp=None, cp=1, **kwargs):
    """Initialise megatron parallel_state (the harness destroys it after the call).

    Args:
        tp: tensor-model-parallel size.
        pp: pipeline-model-parallel size.
        ep: expert-model-parallel size.
        etp: expert-tensor-parallel size (None: same as tp).
        cp: context-parallel size.
        **kwargs: passed through to initialize_model_parallel.
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **kwargs,
    )


@contextlib.contextmanager
def parallel_layout(tp, ep, etp):
    """Initialise the (tp, ep, etp) layout (PP = CP = 1) for the block and destroy it after.

    Yields:
        this rank's (tp_rank, ep_rank, etp_rank).
    """
    from megatron.core import parallel_state as ps

    init_parallel(tp=tp, ep=ep, etp=etp)
    try:
        yield (
            ps.get_tensor_model_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank(),
        )
    finally:
        ps.destroy_model_parallel()


class ParamBag(torch.nn.Module):
    """A bag of parameters with given values; DDP and the optimizers need only parameters.

    Args:
        values: name -> tensor (dtype and device as the parameter should have them).
        expert_names: names whose params carry ``allreduce = False`` (expert params).
        tp_names: names marked tensor-parallel (partition_dim 0).
    """

    def __init__(self, values, expert_names=(), tp_names=()):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for name, value in values.items():
            param = torch.nn.Parameter(value.clone())
            if name in tp_names:
                set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
            if name in expert_names:
                param.allreduce = False
            setattr(self, name, param)


def read_grad_stats(optimizer, grads):
    """Write each (param, value) of ``grads`` into param.main_grad and read the optimizer's
    statistics: found_inf (prepare_grads), grad norm and zero count."""
    for param, value in grads:
        param.main_grad.copy_(value.reshape(param.main_grad.shape))
    found_inf = optimizer.prepare_grads()
    return {
        'found_inf': bool(found_inf),
        'norm': float(optimizer.get_grad_norm()),
        'zeros': int(optimizer.count_zeros()),
    }


def oracle(logical):
    """FP64 norm and zero count over a dict of logical (deduplicated) tensors."""
    flat = torch.cat([v.reshape(-1) for v in logical.values()])
    return {'oracle_norm': float(flat.pow(2).sum().sqrt()), 'oracle_zeros': int((flat == 0).sum())}


def make_config(dtype='fp32', **overrides):
    """A minimal TransformerConfig for the tiny model.

    Args:
        dtype: 'fp32', 'bf16' or 'fp16'.
        **overrides: extra TransformerConfig fields.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        bf16=dtype == 'bf16',
        fp16=dtype == 'fp16',
        params_dtype=DTYPES[dtype],
        pipeline_dtype=DTYPES[dtype],
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def stats_config(dtype='bf16', tp=1, ep=1, etp=None, **overrides):
    """The config of the statistics scenarios' parameter bags and layers: make_config with
    hidden size 16, 4 heads and the (tp, ep, etp) layout; ``overrides`` replace or add fields."""
    layout = dict(
        hidden_size=16,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    return make_config(dtype, **{**layout, **overrides})


def ddp_and_optimizer(config, module, distopt, factory_kwargs=None, **opt_overrides):
    """Wrap ``module`` in DDP (grad_reduce_in_fp32) and build ``get_megatron_optimizer`` over it
    (Adam, lr 0, no clipping, the config's bf16: the standard chained dense + expert optimizer).

    Args:
        distopt: use_distributed_optimizer (DDP and optimizer).
        factory_kwargs: extra keyword arguments of get_megatron_optimizer.
        **opt_overrides: extra or replaced OptimizerConfig fields.

    Returns:
        (model, optimizer).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distopt
    )
    model = DistributedDataParallel(config, ddp_config, module)
    opt_kwargs = dict(
        optimizer='adam', lr=0.0, bf16=config.bf16, use_distributed_optimizer=distopt, clip_grad=0.0
    )
    opt_config = OptimizerConfig(**{**opt_kwargs, **opt_overrides})
    optimizer = get_megatron_optimizer(
        opt_config, [model], use_gloo_process_groups=False, **(factory_kwargs or {})
    )
    return model, optimizer


class TinyCore(torch.nn.Module):
    """Plain-torch body shared by the megatron model and the float64 reference.

    Args:
        expert: add an expert block whose params carry ``allreduce = False`` (so DDP puts them in
            expert_parallel_bucket_groups and the optimizer becomes a ChainedOptimizer).
    """

    def __init__(self, expert=True):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, FFN)
        self.expert = torch.nn.Linear(FFN, FFN) if expert else None
        self.head = torch.nn.Linear(FFN, OUT)
        if expert:
            for p in self.expert.parameters():
                p.allreduce = False

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        if self.expert is not None:
            h = h + torch.tanh(self.expert(h))
        return self.head(h)


def build_model(config, expert=True, seed=1234):
    """TinyModel(MegatronModule) with deterministic init (identical on every rank).

    Args:
        config: TransformerConfig from make_config.
        expert: include the expert block.
        seed: init seed.
    """
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class TinyModel(MegatronModule):
        """MegatronModule with what schedules.py needs: model_type and set_input_tensor."""

        def __init__(self, config):
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.pg_collection = None  # 0.19.2's train_step reads it (None: the mpu groups)
            self.core = TinyCore(expert=expert)

        def set_input_tensor(self, input_tensor):
            pass

        def forward(self, x):
            return self.core(x)

    torch.manual_seed(seed)
    return TinyModel(config)


def wrap_ddp(
    model,
    config,
    overlap=True,
    distopt=True,
    bucket_size=100,
    grad_reduce_in_fp32=False,
    average_in_collective=False,
    **ddp_overrides,
):
    """Cast to bf16/fp16 (Float16Module) when the config asks for it and wrap in megatron DDP.

    Args:
        model: the TinyModel.
        config: its TransformerConfig.
        overlap: overlap_grad_reduce.
        distopt: use_distributed_optimizer.
        bucket_size: DDP bucket size in elements (small -> several buckets / bucket groups).
        grad_reduce_in_fp32: DDP grad_reduce_in_fp32.
        average_in_collective: DDP average_in_collective.
        **ddp_overrides: extra DistributedDataParallelConfig fields.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=distopt,
        bucket_size=bucket_size,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        average_in_collective=average_in_collective,
        **ddp_overrides,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(
    ddp_model, dtype='fp32', distopt=True, optimizer='adam', lr=1e-2, clip_grad=1.0, **overrides
):
    """get_megatron_optimizer with a plain OptimizerConfig (weight decay off by default).

    Args:
        ddp_model: the DDP-wrapped model.
        dtype: 'fp32', 'bf16' or 'fp16' (fp16 uses a dynamic loss scaler).
        distopt: use_distributed_optimizer.
        optimizer: 'adam' or 'sgd'.
        lr: learning rate.
        clip_grad: gradient clipping threshold (0 disables).
        **overrides: extra OptimizerConfig fields.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    kwargs = dict(
        optimizer=optimizer,
        lr=lr,
        min_lr=lr,
        weight_decay=0.0,
        bf16=dtype == 'bf16',
        fp16=dtype == 'fp16',
        params_dtype=DTYPES[dtype],
        use_distributed_optimizer=distopt,
        clip_grad=clip_grad,
        adam_eps=1e-8,
        sgd_momentum=0.9,
    )
    if dtype == 'fp16':
        kwargs.update(initial_loss_scale=2.0**12, loss_scale_window=100, hysteresis=2)
    kwargs.update(overrides)
    chunks = ddp_model if isinstance(ddp_model, list) else [ddp_model]
    return get_megatron_optimizer(OptimizerConfig(**kwargs), chunks)


def microbatch(seed, step, index, micro_batch_size=4):
    """Deterministic (x, y) for global microbatch ``index`` of ``step`` (same on every rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + index)
    x = torch.randn(micro_batch_size, HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randn(micro_batch_size, OUT, generator=g, dtype=torch.float64)
    return x, y


def rank_iterator(seed, step, num_microbatches, dp_rank, device, micro_batch_size=4):
    """This DP rank's microbatches of ``step`` (global index dp_rank * num_microbatches + i)."""
    for i in range(num_microbatches):
        x, y = microbatch(seed, step, dp_rank * num_microbatches + i, micro_batch_size)
        yield x.float().to(device), y.float().to(device)


def _loss_func(y, output):
    loss = torch.nn.functional.mse_loss(output.float(), y)
    return loss, {'loss': loss.detach().clone()}


def _forward_step(data_iterator, model):
    x, y = next(data_iterator)
    return model(x), partial(_loss_func, y)


def inner_core(model):
    """The TinyCore under DDP / Float16Module wrappers."""
    while not isinstance(model, TinyCore):
        model = model.module if hasattr(model, 'module') else model.core
    return model


def flat_params(core):
    """Float64 CPU vector of the TinyCore params, in named_parameters order."""
    return torch.cat([p.detach().double().cpu().reshape(-1) for _, p in core.named_parameters()])


def digest(vec, decimals=6):
    """A short hash of a param vector rounded to ``decimals`` (stable across ranks)."""
    rounded = torch.round(vec.double() * 10**decimals).to(torch.int64).numpy().tobytes()
    return hashlib.sha256(rounded).hexdigest()[:16]


class Trainer:
    """Model + DDP + optimizer + schedule, stepping the way training.py train_step does.

    Args:
        ctx: harness context.
        dtype: 'fp32', 'bf16' or 'fp16'.
        overlap: overlap_grad_reduce.
        distopt: use_distributed_optimizer (DDP and optimizer).
        expert: include an expert (allreduce=False) block.
        bucket_size: DDP bucket size in elements.
        optimizer: 'adam' or 'sgd'.
        lr: learning rate.
        clip_grad: clip threshold.
        seed: model/data seed.
        micro_batch_size: samples per microbatch.
        install_hooks: set config.no_sync_func (with overlap_grad_reduce) and
            finalize_model_grads_func now (set False to mimic steps that run before train()).
        ddp_kwargs: extra DistributedDataParallelConfig fields.
        opt_kwargs: extra OptimizerConfig fields.
        config_kwargs: extra TransformerConfig fields.
    """

    def __init__(
        self,
        ctx,
        dtype='fp32',
        overlap=True,
        distopt=True,
        expert=True,
        bucket_size=100,
        optimizer='adam',
        lr=1e-2,
        clip_grad=1.0,
        seed=1234,
        micro_batch_size=4,
        install_hooks=True,
        ddp_kwargs=None,
        opt_kwargs=None,
        config_kwargs=None,
    ):
        self.ctx = ctx
        self.dtype = dtype
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.config = make_config(dtype, **(config_kwargs or {}))
        model = build_model(self.config, expert=expert, seed=seed)
        self.initial = flat_params(model.core)
        self.initial_state = {k: v.cpu() for k, v in copy.deepcopy(model.core.state_dict()).items()}
        # What reference_train() needs to train the same model on the same data.
        self.reference_kwargs = dict(
            expert=expert,
            optimizer=optimizer,
            lr=lr,
            clip_grad=clip_grad,
            seed=seed,
            micro_batch_size=micro_batch_size,
            initial_state=self.initial_state,
        )
        model = model.to(ctx.device)
        self.model = wrap_ddp(
            model,
            self.config,
            overlap=overlap,
            distopt=distopt,
            bucket_size=bucket_size,
            **(ddp_kwargs or {}),
        )
        self.optimizer = build_optimizer(
            self.model,
            dtype=dtype,
            distopt=distopt,
            optimizer=optimizer,
            lr=lr,
            clip_grad=clip_grad,
            **(opt_kwargs or {}),
        )
        self._start(install_hooks)

    def _start(self, install_hooks):
        """The data-parallel coordinates, a zero step count and the schedule's config hooks."""
        from megatron.core import parallel_state

        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.step_index = 0
        self.config.no_sync_func = None
        self.config.finalize_model_grads_func = None
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.timers = None
        if install_hooks:
            self.install_hooks()

    def install_hooks(self, no_sync=True, finalize=True):
        """Set single schedule hooks by hand: no_sync_func (only with overlap_grad_reduce) and
        finalize_model_grads_func, each on or off. A scenario's own set-up for steps that run
        outside train(); train()'s full set-up is :func:`install_train_loop_hooks`."""
        from megatron.core.distributed import finalize_model_grads

        overlap = self.model.ddp_config.overlap_grad_reduce
        self.config.no_sync_func = self.model.no_sync if (no_sync and overlap) else None
        self.config.finalize_model_grads_func = finalize_model_grads if finalize else None

    def step(self, num_microbatches=2):
        """One training step (zero_grad_buffer, forward_backward, optimizer.step).

        Returns:
            dict with the DP-averaged loss, the grad norm, update success and the step index.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        data = rank_iterator(
            self.seed,
            self.step_index,
            num_microbatches,
            self.dp_rank,
            self.ctx.device,
            self.micro_batch_size,
        )
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[self.model],
            num_microbatches=num_microbatches,
            seq_length=1,
            micro_batch_size=self.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = self.optimizer.step()
        local = torch.stack([d['loss'].float() for d in losses]).mean().reshape(1)
        from megatron.core import parallel_state

        dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
        self.step_index += 1
        return {
            'loss': local.item() / self.dp_size,
            'grad_norm': None if grad_norm is None else float(grad_norm),
            'ok': bool(ok),
            'step': self.step_index - 1,
        }

    def params(self):
        """Float64 vector of the current model params (full on every rank)."""
        return flat_params(inner_core(self.model))


def reference_train(steps, num_microbatches, dp_size, **trainer_settings):
    """Single-process float64 reference of the same training (plain torch).

    ``trainer_settings`` are a Trainer's ``reference_kwargs`` (expert, optimizer, lr, clip_grad,
    seed, micro_batch_size, initial_state): the reference trains what that Trainer trains.

    The loss of a step is the mean over all dp_size * num_microbatches microbatch losses, which is
    what DDP (grad scaled by 1/dp) plus the schedule (loss / num_microbatches) optimise.

    Returns:
        dict with losses, grad_norms (pre-clip) and the final float64 param vector.
    """
    s = types.SimpleNamespace(**trainer_settings)
    torch.manual_seed(s.seed)
    core = TinyCore(expert=s.expert)
    if s.initial_state is not None:
        core.load_state_dict(s.initial_state)
    core = core.double()
    if s.optimizer == 'adam':
        opt = torch.optim.AdamW(
            core.parameters(), lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
    else:
        opt = torch.optim.SGD(core.parameters(), lr=s.lr, momentum=0.9)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        n = dp_size * num_microbatches
        for index in range(n):
            x, y = microbatch(s.seed, step, index, s.micro_batch_size)
            loss = torch.nn.functional.mse_loss(core(x), y) / n
            loss.backward()
            total += loss.item()
        norm = torch.sqrt(sum((p.grad**2).sum() for p in core.parameters())).item()
        if s.clip_grad and s.clip_grad > 0:
            coeff = s.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for p in core.parameters():
                    p.grad.mul_(coeff)
        opt.step()
        losses.append(total)
        norms.append(norm)
    return {'losses': losses, 'grad_norms': norms, 'params': flat_params(core)}


def train_steps(ctx, steps=3, num_microbatches=2, reference=True, **trainer_kwargs):
    """Train ``steps`` real steps and (optionally) compare with the float64 reference.

    Args:
        **trainer_kwargs: :class:`Trainer` arguments (dtype, overlap, distopt, expert, ...).

    Returns:
        dict: losses, grad_norms, ok, param_digest, n_bucket_groups, n_expert_bucket_groups,
        optimizer class, and with reference=True: ref_losses, ref_grad_norms, max_param_diff,
        max_loss_diff, max_grad_norm_diff.
    """
    trainer = Trainer(ctx, **trainer_kwargs)
    out = [trainer.step(num_microbatches) for _ in range(steps)]
    params = trainer.params()
    result = {
        'losses': [o['loss'] for o in out],
        'grad_norms': [o['grad_norm'] for o in out],
        'ok': [o['ok'] for o in out],
        'param_digest': digest(params),
        'n_bucket_groups': len(trainer.model.bucket_groups),
        'n_expert_bucket_groups': len(trainer.model.expert_parallel_bucket_groups),
        'optimizer': type(trainer.optimizer).__name__,
        'dp_size': trainer.dp_size,
    }
    if reference:
        ref = reference_train(steps, num_microbatches, trainer.dp_size, **trainer.reference_kwargs)
        result.update(
            ref_losses=ref['losses'],
            ref_grad_norms=ref['grad_norms'],
            max_loss_diff=max(abs(a - b) for a, b in zip(result['losses'], ref['losses'])),
            max_grad_norm_diff=max(
                abs(a - b) for a, b in zip(result['grad_norms'], ref['grad_norms'])
            ),
            max_param_diff=(params - ref['params']).abs().max().item(),
        )
    return result
