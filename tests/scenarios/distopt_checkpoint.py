"""Scenarios: DistributedOptimizer state through a dist_checkpointing save/load round trip.

Each case builds a DDP-wrapped model of plain parameters with the given sizes (module order; the
buffer lays them out in reverse), the real ``get_megatron_optimizer`` with the distributed
optimizer, takes Adam steps on deterministic gradients written into the grad buffer, saves
``optimizer.sharded_state_dict(...)`` with ``megatron.core.dist_checkpointing.save`` (torch_dist
backend), then builds a second model and optimizer from another seed, loads the checkpoint into it
through ``sharded_state_dict(is_loading=True)``, ``dist_checkpointing.load`` and
``optimizer.load_state_dict``, and compares every local optimizer-state tensor (fp32 main param,
exp_avg, exp_avg_sq, step) bitwise with the saved optimizer's.

A case never raises: save and load errors, the upstream "padded with zeros" warnings and the
mismatching tensors are returned per rank, so one world runs many cases.
"""

import contextlib
import logging
import os
import shutil
import tempfile
import traceback

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tests.scenarios.common import build_optimizer, init_parallel, make_config, wrap_ddp

LOGGER = 'megatron.core.optimizer.distrib_optimizer'
# torch.distributed.checkpoint's CheckpointException derives from BaseException.
CHECKPOINT_ERRORS = (Exception, CheckpointException)


class _Warnings(logging.Handler):
    """Collects the distributed optimizer's warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class FusedAdamLike(torch.optim.Optimizer):
    """Adam with apex/TE FusedAdam's state layout: ``exp_avg`` and ``exp_avg_sq`` per param, the
    step count in the param group. On GPUs megatron picks one of those; on CPU it would fall back
    to torch's AdamW, whose per-param ``step`` tensor the fully_reshardable load path does not
    handle (``KeyError: 'step'`` on every base, with or without multiple buckets)."""

    def __init__(self, params, lr, weight_decay, betas, eps, capturable=False, adam_w_mode=True):
        del capturable
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step (bias-corrected), the step count kept in each param group."""
        assert closure is None
        for group in self.param_groups:
            group['step'] = group.get('step', 0) + 1
            beta1, beta2 = group['betas']
            correction1 = 1 - beta1 ** group['step']
            correction2 = 1 - beta2 ** group['step']
            for param in group['params']:
                if param.grad is None:
                    continue
                state = self.state[param]
                if 'exp_avg' not in state:
                    state['exp_avg'] = torch.zeros_like(param)
                    state['exp_avg_sq'] = torch.zeros_like(param)
                grad = param.grad
                if group['weight_decay'] != 0:
                    if self.adam_w_mode:
                        param.mul_(1 - group['lr'] * group['weight_decay'])
                    else:
                        grad = grad.add(param, alpha=group['weight_decay'])
                state['exp_avg'].mul_(beta1).add_(grad, alpha=1 - beta1)
                state['exp_avg_sq'].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state['exp_avg_sq'] / correction2).sqrt_().add_(group['eps'])
                param.addcdiv_(state['exp_avg'], denom, value=-group['lr'] / correction1)


@contextlib.contextmanager
def fused_adam():
    """get_megatron_optimizer and DistributedOptimizer as they run with apex's FusedAdam."""
    from megatron.core import optimizer as optimizer_module
    from megatron.core.optimizer import distrib_optimizer

    patches = [
        (optimizer_module, 'USING_PYTORCH_OPTIMIZER', False),
        (optimizer_module, 'Adam', FusedAdamLike),
        (distrib_optimizer, 'Adam', FusedAdamLike),
        (distrib_optimizer, 'HAVE_APEX_OR_TE', True),
        (distrib_optimizer, 'USING_APEX_OPTIMIZER', True),
        (distrib_optimizer, 'USING_TE_OPTIMIZER', False),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _model(config, sizes, shared, seed):
    from megatron.core.transformer.module import MegatronModule

    class Params(MegatronModule):
        """Plain parameters; the one at index ``shared`` marked as a shared embedding (it gets
        a bucket of its own, and the bucket before it ends at a 64-aligned offset)."""

        def __init__(self):
            super().__init__(config=config)
            gen = torch.Generator().manual_seed(seed)
            self.p = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(n, generator=gen).to(config.params_dtype))
                for n in sizes
            )
            if shared is not None:
                self.p[shared].shared_embedding = True

    return Params()


def _model_sharded_state_dict(module, dp_rank):
    """The params as replicated ShardedTensors (keep_vars, so the optimizer finds them)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return {
        name: ShardedTensor.from_rank_offsets(name, param, replica_id=(0, 0, dp_rank))
        for name, param in module.named_parameters()
    }


def _distopts(optimizer):
    return list(getattr(optimizer, 'chained_optimizers', [optimizer]))


def _build(ctx, case, seed, steps):
    """Model, DDP, optimizer, and ``steps`` Adam steps on seeded grads (identical on every rank)."""
    config = make_config(case['dtype'])
    module = _model(config, case['sizes'], case.get('shared'), seed)
    ddp = wrap_ddp(module, config, overlap=True, distopt=True, bucket_size=case['bucket_size'])
    optimizer = build_optimizer(ddp, dtype=case['dtype'], distopt=True, clip_grad=0.0)
    params = list(module.parameters())
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        ddp.zero_grad_buffer()
        for param in params:
            param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=gen))
        ok, _, _ = optimizer.step()
        assert ok
    return module, ddp, optimizer


def _states(optimizer):
    """[(label, tensor)] of every local optimizer-state tensor, in bucket order."""
    out = []
    for o_idx, distopt in enumerate(_distopts(optimizer)):
        for gbuf_ranges in distopt.gbuf_ranges:
            for buckets in gbuf_ranges.values():
                for b_idx, gbuf_range_map in enumerate(buckets):
                    for p_idx, model_param in enumerate(gbuf_range_map['param_map']):
                        group, order = distopt.model_param_group_index_map[model_param]
                        main_param = distopt.optimizer.param_groups[group]['params'][order]
                        state = distopt.optimizer.state[main_param]
                        tensors = distopt._get_main_param_and_optimizer_states(model_param)
                        tensors['step'] = state.get(
                            'step', distopt.optimizer.param_groups[group].get('step')
                        )
                        for key in sorted(tensors):
                            value = tensors[key]
                            if value is None:
                                # No step anywhere (never stepped, or an optimizer that keeps
                                # none): no step taken, as a torch group's step 0 says.
                                value = torch.tensor(0)
                            elif not isinstance(value, torch.Tensor):
                                value = torch.tensor(value)
                            out.append((f'opt{o_idx}.bucket{b_idx}.param{p_idx}.{key}', value))
    return out


def _geometry(optimizer):
    return [
        [[b.grad_data.numel(), b.numel_unpadded] for b in buffer.buckets]
        for distopt in _distopts(optimizer)
        for buffer in distopt.buffers
    ]


def _error(exc):
    return f'{type(exc).__name__}: {exc}'.splitlines()[0][:400] if str(exc) else type(exc).__name__


def _release_writers(world_size):
    """The coordinator's half of ``save_state_dict_async_finalize``, after its global plan failed.

    With the default decentralized planning, only the coordinator (rank 0) validates the global
    plan; the other ranks write their shards and wait for a coordinator that has raised, in
    ``AsyncRequest.execute_sync``'s barrier and then the finalize step's ``gather_object`` and
    failure ``broadcast``. Upstream they hang there until the process-group timeout; here rank 0
    answers those three collectives (reporting a failure), so the peers raise
    ``CheckpointException`` and the world goes on with the next case.
    """
    dist.barrier()
    dist.gather_object(None, [None] * world_size, dst=0)
    dist.broadcast(torch.tensor([1], dtype=torch.int), src=0)


def _stage(fn):
    """Run ``fn()`` on every rank; (value, this rank's error, whether any rank failed)."""
    value, error = None, None
    try:
        value = fn()
    except CHECKPOINT_ERRORS as exc:
        traceback.print_exc()  # into the rank log
        error = _error(exc)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return value, error, any(errors)


def _save(ctx, module_a, optimizer_a, dp_rank, metadata, ckpt, result):
    """The sharded state dict, then dist_checkpointing.save (torch_dist); True if staging failed."""
    from megatron.core import dist_checkpointing

    state, result['save_error'], failed = _stage(
        lambda: optimizer_a.sharded_state_dict(
            _model_sharded_state_dict(module_a, dp_rank), metadata=metadata
        )
    )
    if not failed:
        try:
            dist_checkpointing.save(state, ckpt)
        except CHECKPOINT_ERRORS as exc:
            result['save_error'] = _error(exc)
            if ctx.rank == 0 and 'Failed to validate global plan' in str(exc):
                _release_writers(ctx.world_size)
        dist.barrier()
    return failed


def _load(ctx, case, dp_rank, metadata, ckpt, result):
    """Load into an optimizer from another seed, one step in; return (optimizer, failed)."""
    from megatron.core import dist_checkpointing

    module_b, _, optimizer_b = _build(ctx, case, seed=23, steps=1)
    state, result['load_error'], failed = _stage(
        lambda: optimizer_b.sharded_state_dict(
            _model_sharded_state_dict(module_b, dp_rank), is_loading=True, metadata=metadata
        )
    )
    if not failed:
        _, result['load_error'], failed = _stage(
            lambda: optimizer_b.load_state_dict(dist_checkpointing.load(state, ckpt))
        )
    return optimizer_b, failed


def _compare(optimizer_a, optimizer_b, result):
    """Record the compared keys and every state that differs after the round trip."""
    saved, loaded = _states(optimizer_a), _states(optimizer_b)
    assert [k for k, _ in saved] == [k for k, _ in loaded]
    mismatches = []
    for (key, a), (_, b) in zip(saved, loaded):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
            mismatches.append(
                {
                    'key': key,
                    'differ': int((a64 != b64).sum()) if a64.shape == b64.shape else -1,
                    'numel': a.numel(),
                    'loaded_zeros': int((b64 == 0).sum()),
                }
            )
    result['compared'] = [k for k, _ in saved]
    result['mismatches'] = mismatches


def _round_trip(ctx, case, root):
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    metadata = {'distrib_optim_sharding_type': case['sharding']}
    if case['sharding'] == 'fully_reshardable':
        metadata['distrib_optim_fully_reshardable_mem_efficient'] = case.get('mem_efficient', False)
    result = {'name': case['name'], 'save_error': None, 'load_error': None}
    handler = _Warnings()
    logging.getLogger(LOGGER).addHandler(handler)
    try:
        module_a, _, optimizer_a = _build(ctx, case, seed=11, steps=case.get('steps', 2))
        result['geometry'] = _geometry(optimizer_a)
        ckpt = os.path.join(root, case['name'])
        if ctx.rank == 0:
            os.makedirs(ckpt)
        dist.barrier()

        failed = _save(ctx, module_a, optimizer_a, dp_rank, metadata, ckpt, result)
        result['save_warnings'] = [m for m in handler.messages if 'padded with zeros' in m]
        if result['save_error'] is not None or failed:
            result['files'] = sorted(os.listdir(ckpt))
            return result

        optimizer_b, failed = _load(ctx, case, dp_rank, metadata, ckpt, result)
        if failed:
            return result

        _compare(optimizer_a, optimizer_b, result)
        return result
    finally:
        logging.getLogger(LOGGER).removeHandler(handler)


def scenario_round_trips(ctx, cases):
    """Run each case's save/load round trip in this world; one result dict per case."""
    with fused_adam():
        return _round_trips(ctx, cases)


def _round_trips(ctx, cases):
    init_parallel()
    root = [tempfile.mkdtemp(prefix='distopt-ckpt-') if ctx.rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    try:
        results = []
        for case in cases:
            try:
                results.append(_round_trip(ctx, case, root[0]))
            except Exception as exc:  # noqa: BLE001 - a broken case must not hide the others
                results.append({'name': case['name'], 'error': _error(exc)})
            dist.barrier()
        return {'cases': results}
    finally:
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(root[0], ignore_errors=True)
