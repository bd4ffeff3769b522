# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""``--warmup-train-steps N``: synthetic training steps at the start of train(), then an exact
restore, so one-time costs (kernel selection, allocator growth, communicator set-up, compilation)
fall outside every logged iteration and the real run starts as it would have without them.

train() calls run_warmup() right after its own loop set-up (install_train_loop_hooks()), with its
train_step and the param_sync_func that set-up held back, so the steps run under that very set-up
and hand it back as the first real step expects it; state_snapshot.py captures and restores the
state.
"""

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import torch

from megatron.training.state_snapshot import TrainingStateSnapshot, sub_optimizers

# Model-config fields install_train_loop_hooks() sets; put back after the steps.
CONFIG_CALLBACKS = tuple(
    'no_sync_func grad_sync_func param_sync_func finalize_model_grads_func grad_scale_func'.split()
)
# train_step()'s per-iteration dumps, off while the warmup runs.
_DUMPS = (
    'save_params_interval',
    'save_activations_interval',
    'save_tokens_per_expert_interval',
    'save_wgrads_interval',
    'save_dgrads_interval',
)
# Flags (of the args or of an optimizer's config) whose state the restore does not cover.
_UNSUPPORTED_FLAGS = (
    'use_megatron_fsdp use_torch_fsdp2 perform_rl_step optimizer_cpu_offload '
    'chunked_optimizer_state_offload offload_optimizer_states'
).split()


class WarmupUnsupportedError(ValueError):
    """The run uses a combination the warmup cannot run and restore exactly."""


class WarmupPeerError(RuntimeError):
    """A warmup step raised on another rank; this rank restored its state as well."""


@dataclass
class WarmupReport:
    """What a warmup did: steps, bytes staged in host memory, DDP bucket groups reset (collectives
    drained; groups whose own calibration was kept), each step's loss and time, the steps the
    loss scaler skipped, the wall time, and ``one_time_cost``: the first step's time minus the
    median of the later ones (None with one step), i.e. what the warmup moved out of the real
    run, and ``compilations``: the torch.compile compilations (``jit_fuser`` fusions,
    recompiles included) during the steps, which the real run would otherwise make in its first
    iterations."""

    num_steps: int = 0
    host_staging_bytes: int = 0
    bucket_groups_reset: int = 0
    collectives_drained: int = 0
    calibration_kept: int = 0
    losses: List[Any] = field(default_factory=list)
    step_seconds: List[float] = field(default_factory=list)
    skipped_steps: int = 0
    one_time_cost: Optional[float] = None
    seconds: float = 0.0
    compilations: int = 0


def _unsupported(what: str) -> WarmupUnsupportedError:
    return WarmupUnsupportedError(f'--warmup-train-steps does not support {what}')


def pipeline_layout(model, config, args) -> tuple:
    """(pipeline size, pipeline rank) as the schedules see them. The args, the model config and
    the process groups must agree, with one model chunk per virtual pipeline stage; otherwise
    WarmupUnsupportedError names what disagrees.

    Args:
        model: list of model chunks.
        config: the model config the schedules read.
        args: Megatron global args.
    """
    from megatron.core import parallel_state

    groups = parallel_state.model_parallel_is_initialized()
    layout = []
    for name in ('pipeline_model_parallel_size', 'virtual_pipeline_model_parallel_size'):
        sizes = {'args': getattr(args, name, None), 'model config': getattr(config, name, None)}
        if groups:
            sizes['process groups'] = getattr(parallel_state, f'get_{name[:-5]}_world_size')()
        sizes = {where: int(size or 1) for where, size in sizes.items()}
        if len(set(sizes.values())) > 1:
            found = ', '.join(f'{size} in the {where}' for where, size in sizes.items())
            raise _unsupported(f'an inconsistent layout ({name}: {found})')
        layout.append(max(sizes.values()))
    if len(model) != layout[1]:
        raise _unsupported(
            f'{len(model)} model chunks with virtual_pipeline_model_parallel_size={layout[1]} '
            '(one chunk per virtual pipeline stage)'
        )
    return layout[0], parallel_state.get_pipeline_model_parallel_rank() if groups else 0


def _failed_ranks(failed: bool) -> List[int]:
    """The ranks on which the current step raised (one small all-reduce over the world), so that
    every rank restores and raises, not only the failing one."""
    if not torch.distributed.is_initialized():
        return [0] if failed else []
    device = torch.cuda.current_device() if torch.cuda.is_available() else 'cpu'
    flags = torch.zeros(torch.distributed.get_world_size(), dtype=torch.int32, device=device)
    flags[torch.distributed.get_rank()] = int(failed)
    torch.distributed.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def check_warmup_supported(model, optimizer, config, args) -> None:
    """Raise WarmupUnsupportedError naming the first unsupported combination.

    Args:
        model: list of model chunks.
        optimizer: the Megatron optimizer (None is unsupported).
        config: the model config the schedules read.
        args: Megatron global args.
    """
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        is_graph_safe_cuda_rng_tracker,
    )

    pipeline_layout(model, config, args)
    if optimizer is None:
        raise WarmupUnsupportedError('--warmup-train-steps needs an optimizer (got None)')
    configs = [('', args)] + [
        (' (optimizer config)', opt.config) for opt in sub_optimizers(optimizer)
    ]
    for name in _UNSUPPORTED_FLAGS:
        for where, obj in configs:
            if getattr(obj, name, False):
                raise _unsupported(f'--{name.replace("_", "-")}{where}')
    if not all(isinstance(chunk, DDP) for chunk in model):
        raise _unsupported(f'model chunks that are not Megatron DDP ({type(model[0]).__name__})')
    for name in ('fp8', 'fp4'):
        if getattr(config, name, None):  # TE keeps amax histories and scales outside the modules
            raise WarmupUnsupportedError(
                f'--warmup-train-steps cannot restore Transformer Engine {name.upper()} scaling '
                f'state yet ({name}={getattr(config, name)!r}, '
                f'{name}_recipe={getattr(config, f"{name}_recipe", None)!r})'
            )
    if is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker()):
        # Its states are live generator handles: the snapshot of get_states() would not copy them.
        raise _unsupported('a graph-safe CUDA RNG tracker (--te-rng-tracker, CUDA graphs)')


def _calibration_is_real(config, args) -> bool:
    """Whether the grad-ready counts the steps record are a first real step's: train()'s
    no_sync_func lets only the last microbatch register (routed expert params: see
    _routed_params)."""
    return bool(args.overlap_grad_reduce and config.no_sync_func is not None)


def _routed_params(model, config) -> set:
    """The params whose grad-ready count may depend on what a router sends them, so that
    the warmup's synthetic batches may calibrate them differently from the real ones.

    Not counted: the experts of a MoELayer whose experts module is exactly SequentialMLP, which
    runs every local expert, on an empty slice when it got no token (the weight grad of an empty
    input is a zero tensor), or TEGroupedMLP, whose grouped GEMM returns a weight grad for every
    expert whatever the token split. Counted: the experts of any other experts module (a subclass
    may skip an expert that got no token) and, with num_moe_experts set, expert params
    (``allreduce`` False) outside a MoELayer.
    """
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    routed, in_moe_layers = set(), set()
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                params = set(module.experts.parameters())
                in_moe_layers |= params
                if type(module.experts) not in (SequentialMLP, TEGroupedMLP):
                    routed |= params
        if getattr(config, 'num_moe_experts', None):
            experts = {p for p in chunk.parameters() if not getattr(p, 'allreduce', True)}
            routed |= experts - in_moe_layers
    return routed


def _hold_loss_scale(optimizer) -> None:
    """Set fp16's dynamic loss scale to 1 for the next warmup step.

    The scaler starts at --initial-loss-scale (2**32 by default), where the fp16 grads overflow
    and it skips the optimizer step until it has backed off, so no warmup step would reach the
    optimizer step the warmup exists to warm. Unscaled grads overflow only where any scale
    would; the snapshot puts the scaler's state back afterwards.
    """
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    for opt in sub_optimizers(optimizer):
        scaler = getattr(opt, 'grad_scaler', None)
        if isinstance(scaler, DynamicGradScaler):
            state = {'growth_tracker': 0, 'hysteresis_tracker': scaler.hysteresis}
            scaler.load_state_dict({'scale': torch.ones_like(scaler.scale), **state})


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def _outside_timers_and_dumps(args):
    """Switch train_step()'s dumps off and give every timer its previous elapsed time back."""
    from megatron.training.global_vars import get_timers

    dumps = {name: getattr(args, name) for name in _DUMPS if getattr(args, name, None)}
    for name in dumps:
        setattr(args, name, None)
    try:
        timers = get_timers()
    except AssertionError:  # timers not set up (a loop outside pretrain())
        timers = None
    elapsed = (
        {n: t.elapsed(reset=False) for n, t in timers.get_all_timers().items()} if timers else {}
    )
    try:
        yield
    finally:
        for name, value in dumps.items():
            setattr(args, name, value)
        for name, timer in timers.get_all_timers().items() if timers else ():
            timer.set_elapsed(elapsed.get(name, 0.0))  # those the steps created read 0


def synthetic_gpt_batches(args, seed_offset: int = 9973) -> Iterator[dict]:
    """Endless GPT-style micro-batches at the training micro-batch size, from a private generator.

    Args:
        args: Megatron global args (micro_batch_size, seq_length, padded_vocab_size, seed).
        seed_offset: added to args.seed for the private generator.
    """
    mbs, seq = args.micro_batch_size, args.seq_length
    vocab = getattr(args, 'padded_vocab_size', None) or getattr(args, 'vocab_size', None) or 1024
    gen = torch.Generator().manual_seed(int(args.seed) + seed_offset)
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(mbs, -1).contiguous()
    while True:
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen, dtype=torch.long)
        batch = {'tokens': tokens[:, :-1].contiguous(), 'labels': tokens[:, 1:].contiguous()}
        batch.update(loss_mask=torch.ones(mbs, seq), position_ids=position_ids)
        if getattr(args, 'create_attention_mask_in_dataloader', False):
            mask = ~torch.tril(torch.ones(seq, seq, dtype=torch.bool))
            batch['attention_mask'] = mask.expand(mbs, 1, seq, seq).contiguous()
        yield batch


class _LoopSetup:
    """train()'s loop set-up as install_train_loop_hooks() left it: the config callbacks,
    whether each chunk's forward pre-hooks are on, and what that means for the grad-ready
    calibration the steps record (real: see _calibration_is_real, except in the bucket groups of
    the routed params). The steps enable the pre-hooks after the first step that ran, as train()
    does; restore() hands the set-up back as it was found."""

    def __init__(self, model, config, param_sync_func: Optional[Callable], args):
        self.model, self.config, self.param_sync_func = model, config, param_sync_func
        self.calibration_is_real = _calibration_is_real(config, args)
        self.routed = _routed_params(model, config)
        self.callbacks = {name: getattr(config, name) for name in CONFIG_CALLBACKS}
        self.hooks = [bool(chunk.remove_forward_pre_hook_handles) for chunk in model]
        # install_train_loop_hooks() disabled the pre-hooks for the first step.
        self.pending = any(
            chunk.use_forward_hook and not on for chunk, on in zip(model, self.hooks)
        )

    def after_step(self, skipped) -> None:
        """Enable the pre-hooks (and param_sync_func) after the first step that ran."""
        if self.pending and not skipped:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
            self.config.param_sync_func = self.param_sync_func
            self.pending = False

    def restore(self) -> None:
        """The config callbacks as installed, each chunk's pre-hooks as they were."""
        for name, value in self.callbacks.items():
            setattr(self.config, name, value)
        for chunk, enabled in zip(self.model, self.hooks):
            if chunk.use_forward_hook and bool(chunk.remove_forward_pre_hook_handles) != enabled:
                if enabled:
                    chunk.enable_forward_pre_hook()
                else:
                    chunk.disable_forward_pre_hook(param_sync=False)


def _checked_num_steps(num_steps, args) -> int:
    num_steps = args.warmup_train_steps if num_steps is None else num_steps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f'warmup_train_steps must be a non-negative integer, got {num_steps!r}')
    return num_steps


def _step_args(
    forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, args
) -> tuple:
    """train_step()'s positional arguments. Without a data_iterator: synthetic batches for the
    first chunk of the first stage and the last chunk of the last stage; the others read none (as
    pretrain_gpt's get_batch). Each stage draws the same ones."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator

    if data_iterator is None:
        size, rank = pipeline_layout(model, config, args)
        stages = ((0, 0), (size - 1, len(model) - 1))
        data_iterator = [
            RerunDataIterator(synthetic_gpt_batches(args)) if (rank, i) in stages else None
            for i in range(len(model))
        ]
        data_iterator = data_iterator if len(model) > 1 else data_iterator[0]
    step_args = (forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config)
    return step_args + (get_forward_backward_func(),)


def _run_step(train_step_func: Callable, step_args: tuple, step: int, report, args):
    """One warmup step; a step that raised on one rank (pipeline stage) fails it on every rank."""
    error, started = None, _now()
    try:
        result = train_step_func(*step_args, iteration=args.iteration)
        report.step_seconds.append(_now() - started)
    except Exception as exc:  # pylint: disable=broad-except
        error = exc
    failed = _failed_ranks(error is not None)
    if failed:
        raise error or WarmupPeerError(
            f'warmup step {step + 1} failed on rank(s) {failed}; restored here too'
        )
    return result


def _run_steps(
    train_step_func: Callable, step_args: tuple, setup: _LoopSetup, optimizer, report, args
):
    """The warmup steps, as train() runs them, outside its timers and dumps."""
    with _outside_timers_and_dumps(args):
        for chunk in setup.model:
            chunk.train()
        for step in range(report.num_steps):
            _hold_loss_scale(optimizer)
            result = _run_step(train_step_func, step_args, step, report, args)
            report.losses.append(result[0])
            report.skipped_steps += int(bool(result[1]))
            setup.after_step(result[1])


def _restore_state(snapshot, report, setup: _LoopSetup, step_failed: bool) -> None:
    """Restore the snapshot, keeping the grad-ready calibration of the steps where it is a first
    real step's; after a failed step, a failing restore does not hide the step's error."""
    from megatron.training.utils import print_rank_0

    try:
        restored = snapshot.restore(setup.calibration_is_real and not step_failed, setup.routed)
        report.bucket_groups_reset, report.collectives_drained, report.calibration_kept = restored
        print_rank_0(
            f'[warmup] Reset DDP grad-ready calibration on {restored[0]} bucket groups '
            f'({restored[1]} outstanding collectives drained; '
            f'calibration kept on {restored[2]})'
        )
    except Exception as restore_error:  # pylint: disable=broad-except
        if not step_failed:
            raise
        # Keep the warmup step's exception, which is the one worth seeing.
        print_rank_0(f'[warmup] restore after a failed step also failed: {restore_error!r}')


def _compiled_graphs() -> int:
    """Frames torch.compile has compiled in this process so far, recompiles included (0 without
    dynamo)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return counters['frames']['ok']


def _log_report(report: WarmupReport) -> None:
    """Wait for every rank, so that all start their first real step together, and log."""
    from megatron.training.utils import print_rank_0

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    first, later = report.step_seconds[0], report.step_seconds[1:]
    cost = f'first step {first:.2f}s'
    if later:
        report.one_time_cost = first - statistics.median(later)
        cost += (
            f', later ones {statistics.median(later):.2f}s: {report.one_time_cost:.2f}s of '
            'one-time cost moved out of the real run'
        )
    if report.skipped_steps:
        cost += f'; {report.skipped_steps} skipped by the loss scaler'
    cost += f'; {report.compilations} torch.compile compilations'
    print_rank_0(
        f'[warmup] Ran {report.num_steps} warmup train steps in {report.seconds:.2f}s ({cost}) '
        'and restored the model, optimizer, scheduler, RNG and counters '
        f'({report.host_staging_bytes / 2**20:.1f} MiB staged in host memory)'
    )


def run_warmup(
    train_step_func: Callable,
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    config,
    param_sync_func: Optional[Callable] = None,
    num_steps: Optional[int] = None,
    data_iterator=None,
    args=None,
) -> WarmupReport:
    """Run ``num_steps`` synthetic training steps as train() runs them, then restore all state
    exactly, also when a step raises (the exception is re-raised after the restore).

    train() calls it right after install_train_loop_hooks() (code that runs steps outside
    train() calls that first too). The steps run under that set-up, enabling the forward
    pre-hooks after the first successful step as train() does, and hand it back as found: the
    config callbacks as installed, pre-hooks and ``param_sync_func`` held back where it did so.

    Args:
        train_step_func: the step train() runs (training.train_step), with its signature.
        forward_step_func: the training forward step, as passed to train_step().
        model: list of model chunks (Megatron DDP).
        optimizer: the Megatron optimizer.
        opt_param_scheduler: the OptimizerParamScheduler, or None.
        config: the model config (``get_model_config(model[0])``).
        param_sync_func: what install_train_loop_hooks() returned (put on the config with the
            pre-hooks after the first successful step, and held back again afterwards).
        num_steps: number of warmup steps (default: ``args.warmup_train_steps``); 0 does nothing.
        data_iterator: micro-batches as train_step() takes them (RerunDataIterator, a list per
            model chunk). Default: synthetic_gpt_batches(args) on the stages that read batches.
        args: Megatron global args (default: get_args()).
    """
    from megatron.training.global_vars import get_args

    args = args if args is not None else get_args()
    num_steps = _checked_num_steps(num_steps, args)
    if num_steps == 0:
        return WarmupReport()
    model = model if isinstance(model, list) else [model]
    check_warmup_supported(model, optimizer, config, args)
    step_args = _step_args(
        forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, args
    )
    start = time.time()
    snapshot = TrainingStateSnapshot(model, optimizer, opt_param_scheduler, args)
    report = WarmupReport(num_steps=num_steps, host_staging_bytes=snapshot.nbytes)
    setup = _LoopSetup(model, config, param_sync_func, args)
    step_failed = True
    graphs_before = _compiled_graphs()
    try:
        _run_steps(train_step_func, step_args, setup, optimizer, report, args)
        step_failed = False
    finally:
        report.compilations = _compiled_graphs() - graphs_before
        setup.restore()
        _restore_state(snapshot, report, setup, step_failed)
        gc.collect()  # the warmup's garbage, now rather than inside the first real iterations
        report.seconds = time.time() - start
    _log_report(report)
    return report
