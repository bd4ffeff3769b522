"""Scenarios: the checkpoint-resume candidates 1-6 of issue 30, through the real save/load path.

Two kinds of calls, both on CPU ranks (gloo), any tree:

- :func:`scenario_scheduler` (candidates 1 and 2): a DistributedOptimizer from
  ``get_megatron_optimizer`` (optionally with a per-module LR override) and an
  ``OptimizerParamScheduler`` train ``steps`` steps (run A); the optimizer's sharded state dict and
  the scheduler's state dict are saved with ``dist_checkpointing.save``; a fresh optimizer and
  scheduler (run B, possibly with a new LR and ``override_opt_param_scheduler``) load them the way
  ``megatron.training.checkpointing.load_checkpoint`` does (optimizer first, then scheduler).
  Each group's LR after the load is compared with the other arm of the same run: run A at the same
  step (no new arguments), or run C, built with the new arguments and stepped to the same step
  without any checkpoint (``override_opt_param_scheduler``).
- :func:`scenario_round_trips` (candidates 3-6): run A takes ``steps`` Adam steps and saves
  ``optimizer.sharded_state_dict(...)`` (and the model params) with ``dist_checkpointing.save``;
  run B, built from another seed with ``load_steps`` steps of its own (0: a fresh optimizer, as a
  restarted process has), loads it through ``sharded_state_dict(is_loading=True)``,
  ``dist_checkpointing.load`` and ``load_state_dict``. Every local optimizer-state tensor (main
  param, exp_avg, exp_avg_sq, step) of B is compared bitwise with A's; then A (the run that never
  stopped) and B take one more step on the same gradients and their model params are compared.

Adam is either the apex/TE FusedAdam layout (``adam='fused'``, step count in the param group, as
on GPUs; see ``distopt_checkpoint.FusedAdamLike``; ``'nostep'``: the same layout without any
step count, as Lion has), or torch's own ``Adam``/``AdamW`` (``adam='torch'``/``'torch_w'``:
what megatron uses without apex/TE, step per param).

A case never raises: errors of each stage are returned per rank, so one world runs many cases.
"""

import contextlib
import os
import shutil
import tempfile
import traceback

import torch
import torch.distributed as dist

from tests.scenarios.common import init_parallel, make_config
from tests.scenarios.distopt_checkpoint import (
    CHECKPOINT_ERRORS,
    FusedAdamLike,
    _distopts,
    _error,
    _geometry,
    _release_writers,
    _stage,
    _states,
    fused_adam,
)

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
SCHEDULE = dict(
    lr_warmup_steps=2,
    lr_decay_steps=20,
    lr_decay_style='cosine',
    start_wd=0.01,
    end_wd=0.01,
    wd_incr_steps=20,
    wd_incr_style='constant',
)


# ---------------------------------------------------------------------------------------------
# Building blocks


def _module(config, case, seed):
    """Plain 1-D parameters of ``case['sizes']`` (module order; the grad buffer lays them out in
    reverse), each in its own dtype (``case['dtypes']``, default ``case['dtype']``); the indices
    in ``case['expert']`` carry ``allreduce = False`` (a second, expert DistributedOptimizer)."""
    from megatron.core.transformer.module import MegatronModule

    dtypes = case.get('dtypes') or [case['dtype']] * len(case['sizes'])
    experts = set(case.get('expert', ()))

    class Params(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            gen = torch.Generator().manual_seed(seed)
            self.p = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(n, generator=gen).to(DTYPES[d]))
                for n, d in zip(case['sizes'], dtypes)
            )
            for i in experts:
                self.p[i].allreduce = False

    return Params()


class NoStepAdam(FusedAdamLike):
    """The FusedAdam layout without a step count anywhere (as Lion and other optimizers that
    keep none): every step bias-corrects as a first one, and the param groups carry no 'step'."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            del group['step']


@contextlib.contextmanager
def _adam(kind):
    """The optimizer class get_megatron_optimizer picks: the FusedAdam layout (``'nostep'``:
    one without a step count) or torch's own."""
    if kind in ('fused', 'nostep'):
        from megatron.core import optimizer as optimizer_module

        with fused_adam():
            optimizer_module.Adam = NoStepAdam if kind == 'nostep' else FusedAdamLike
            try:
                yield
            finally:
                optimizer_module.Adam = FusedAdamLike
    else:
        yield


def _build(case, seed, lr=None, overrides=None):
    """DDP (distributed optimizer, no Float16Module: each param keeps its own dtype) and
    ``get_megatron_optimizer``; ``overrides`` = [(name pattern, ParamGroupOverride)]."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer

    config = make_config(case['dtype'])
    module = _module(config, case, seed)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=case['bucket_size']
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    lr = case.get('lr', 1e-2) if lr is None else lr
    opt_config = OptimizerConfig(
        optimizer='adam',
        lr=lr,
        min_lr=lr / 10,
        weight_decay=0.0,
        decoupled_weight_decay=case.get('adam', 'fused') != 'torch',
        bf16=case['dtype'] == 'bf16',
        params_dtype=DTYPES[case['dtype']],
        use_distributed_optimizer=True,
        clip_grad=0.0,
        adam_eps=1e-8,
    )
    config_overrides = None
    if overrides:
        config_overrides = {ParamKey(name=pattern): dict(o) for pattern, o in overrides}
    optimizer = get_megatron_optimizer(opt_config, [ddp], config_overrides=config_overrides)
    return module, ddp, optimizer


def _step(module, ddp, optimizer, step):
    """One optimizer step on gradients seeded by ``step`` only (equal in every run)."""
    gen = torch.Generator().manual_seed(7919 + step)
    ddp.zero_grad_buffer()
    for param in module.parameters():
        param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=gen))
    ok, _, _ = optimizer.step()
    assert ok


def _model_state(module, dp_rank, copies=False):
    """The model params as replicated ShardedTensors: the params themselves (keep_vars, what the
    optimizer's sharded_state_dict needs) or, with ``copies``, detached copies (what the model part
    of a checkpoint saves and loads)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return {
        name: ShardedTensor.from_rank_offsets(
            f'model.{name}', param.detach().clone() if copies else param, replica_id=(0, 0, dp_rank)
        )
        for name, param in module.named_parameters()
    }


def _any(error):
    """Whether any rank reports an error."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return any(errors)


def _save(ctx, state, ckpt):
    """dist_checkpointing.save on every rank; this rank's error (None if saved)."""
    from megatron.core import dist_checkpointing

    error = None
    try:
        dist_checkpointing.save(state, ckpt)
    except CHECKPOINT_ERRORS as exc:
        traceback.print_exc()
        error = _error(exc)
        if ctx.rank == 0 and 'Failed to validate global plan' in str(exc):
            _release_writers(ctx.world_size)
    dist.barrier()
    return error


def _metadata(case):
    metadata = {'distrib_optim_sharding_type': case['sharding']}
    if case['sharding'] == 'fully_reshardable':
        metadata['distrib_optim_fully_reshardable_mem_efficient'] = False
    return metadata


def _with_checkpoint_root(ctx, fn):
    """``fn(root)`` with a fresh directory shared by all ranks (removed afterwards)."""
    root = [tempfile.mkdtemp(prefix='resume-cand-') if ctx.rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    try:
        return fn(root[0])
    finally:
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(root[0], ignore_errors=True)


def _cases(ctx, cases, one):
    def run(root):
        results = []
        for case in cases:
            try:
                with _adam(case.get('adam', 'fused')):
                    results.append(one(ctx, case, root))
            except Exception as exc:  # noqa: BLE001 - a broken case must not hide the others
                traceback.print_exc()
                results.append({'name': case['name'], 'error': _error(exc)})
            dist.barrier()
        return {'cases': results}

    init_parallel()
    return _with_checkpoint_root(ctx, run)


# ---------------------------------------------------------------------------------------------
# Candidates 1 and 2: the optimizer param scheduler and per-group LRs on resume


def _scheduler(optimizer, max_lr, override, schedule):
    """``schedule``: the case's changes to ``SCHEDULE`` (the class weight-decay schedule)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=max_lr,
        min_lr=max_lr / 10,
        use_checkpoint_opt_param_scheduler=not override,
        override_opt_param_scheduler=override,
        **{**SCHEDULE, **schedule},
    )


def _groups(optimizer):
    """Per param group (over the chained optimizers): lr, max_lr, min_lr, weight_decay, the
    per-group start_wd/end_wd (None: the scheduler's), #params."""
    return [
        {
            'lr': float(g['lr']),
            'max_lr': g.get('max_lr'),
            'min_lr': g.get('min_lr'),
            'weight_decay': g.get('weight_decay'),
            'start_wd': g.get('start_wd'),
            'end_wd': g.get('end_wd'),
            'params': len(g['params']),
        }
        for g in optimizer.param_groups
    ]


def _group_of(module, optimizer):
    """{param name: index of its group in ``optimizer.param_groups``} for the params this rank
    holds a piece of (the group order follows the override values, so it may differ by run)."""
    names = {param: name for name, param in module.named_parameters()}
    out, offset = {}, 0
    for distopt in _distopts(optimizer):
        for param, (group, _) in distopt.model_param_group_index_map.items():
            out[names[param]] = offset + group
        offset += len(distopt.optimizer.param_groups)
    return out


def _scheduler_case(ctx, case, root):
    from megatron.core import dist_checkpointing, parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    metadata = _metadata(case)
    lr_a = case.get('lr', 1e-2)
    lr_b = case.get('resume_lr') or lr_a
    override = case.get('override_flag', False)
    schedule = case.get('schedule', {})
    schedule_b = {**schedule, **case.get('resume_schedule', {})}
    result = {'name': case['name']}

    # Run A: train, then save optimizer + scheduler as load_checkpoint expects them.
    module_a, ddp_a, opt_a = _build(case, seed=11, lr=lr_a, overrides=case.get('overrides'))
    sched_a = _scheduler(opt_a, lr_a, override=False, schedule=schedule)
    for step in range(case['steps']):
        _step(module_a, ddp_a, opt_a, step)
        sched_a.step(increment=1)
    result['run_a'] = _groups(opt_a)
    result['group_of_a'] = _group_of(module_a, opt_a)
    ckpt = os.path.join(root, case['name'])
    if ctx.rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    state = {
        'optimizer': opt_a.sharded_state_dict(_model_state(module_a, dp_rank), metadata=metadata),
        'opt_param_scheduler': sched_a.state_dict(),
    }
    result['save_error'] = _save(ctx, state, ckpt)
    if result['save_error'] is not None:
        return result

    # Run C: the new arguments from the start, stepped to the same step without a checkpoint.
    module_c, _, opt_c = _build(case, seed=23, lr=lr_b, overrides=case.get('resume_overrides'))
    sched_c = _scheduler(opt_c, lr_b, override=override, schedule=schedule_b)
    sched_c.step(increment=case['steps'])
    result['run_c'] = _groups(opt_c)

    # Run B: a fresh optimizer and scheduler with the resume arguments load the checkpoint.
    module_b, _, opt_b = _build(case, seed=23, lr=lr_b, overrides=case.get('resume_overrides'))
    sched_b = _scheduler(opt_b, lr_b, override=override, schedule=schedule_b)
    result['run_b_built'] = _groups(opt_b)
    result['group_of_b'] = _group_of(module_b, opt_b)
    state = {
        'optimizer': opt_b.sharded_state_dict(
            _model_state(module_b, dp_rank), is_loading=True, metadata=metadata
        ),
        'opt_param_scheduler': sched_b.state_dict(),
    }
    _, result['load_error'], failed = _stage(
        lambda: _load_into(opt_b, sched_b, dist_checkpointing.load(state, ckpt))
    )
    if failed:
        return result
    result['run_b'] = _groups(opt_b)
    result['num_steps'] = [sched_a.num_steps, sched_b.num_steps, sched_c.num_steps]
    return result


def _load_into(optimizer, scheduler, loaded):
    """load_checkpoint's order: the optimizer state first, then the scheduler."""
    optimizer.load_state_dict(loaded['optimizer'])
    scheduler.load_state_dict(loaded['opt_param_scheduler'])


def scenario_scheduler(ctx, cases):
    """Candidates 1-2: one result per case (group LRs of runs A, B and C)."""
    return _cases(ctx, cases, _scheduler_case)


# ---------------------------------------------------------------------------------------------
# Candidates 3-6: optimizer state round trips


def _map_check(optimizer):
    """Per distributed optimizer: how many local model params the group-index map sends to a main
    param other than the one built for them ([wrong, total])."""
    out = []
    for distopt in _distopts(optimizer):
        built = {}
        for model_groups, main_groups in (
            (distopt.model_float16_groups, distopt.shard_fp32_from_float16_groups),
            (distopt.model_fp32_groups, distopt.shard_fp32_groups),
        ):
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main_param in zip(model_group, main_group):
                    built[model_param] = main_param
        wrong = 0
        for model_param, main_param in built.items():
            group, order = distopt.model_param_group_index_map[model_param]
            wrong += distopt.optimizer.param_groups[group]['params'][order] is not main_param
        out.append([wrong, len(built)])
    return out


def _local_counts(optimizer):
    """Per optimizer, buffer and bucket: how many params this rank holds a piece of."""
    return [
        [
            [len(r['param_map']) for r in ranges]
            for g in distopt.gbuf_ranges
            for ranges in g.values()
        ]
        for distopt in _distopts(optimizer)
    ]


def _find_key(obj, key, path=()):
    """Paths under ``obj`` (dicts and lists) that end in ``key``."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                found.append([str(p) for p in path + (k,)])
            found.extend(_find_key(v, key, path + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found.extend(_find_key(v, key, path + (i,)))
    return found


def _step_state(optimizer):
    """Per local main param: its 'step' (torch Adam) or its group's (FusedAdam layout), and
    whether the per-param step tensors are one shared object."""
    steps, ids = [], set()
    for distopt in _distopts(optimizer):
        for group in distopt.optimizer.param_groups:
            for param in group['params']:
                value = distopt.optimizer.state[param].get('step', group.get('step'))
                if isinstance(value, torch.Tensor):
                    ids.add(id(value))
                    value = value.item()
                steps.append(value)
    return {'steps': steps, 'shared_step_tensor': len(ids) == 1 and len(steps) > 1}


def _run_a(ctx, case, root, dp_rank, metadata, result):
    """Run A: build, record its layout, take ``steps`` steps and save.

    Returns (module, ddp, optimizer, checkpoint folder, whether staging or saving failed).
    """
    from megatron.core import dist_checkpointing

    module_a, ddp_a, opt_a = _build(case, seed=11)
    result['geometry'] = _geometry(opt_a)
    result['local_params'] = _local_counts(opt_a)
    result['map_wrong'] = _map_check(opt_a)
    for step in range(case['steps']):
        _step(module_a, ddp_a, opt_a, step)
    ckpt = os.path.join(root, case['name'])
    if ctx.rank == 0:
        os.makedirs(ckpt)
    dist.barrier()

    state, result['save_error'], failed = _stage(
        lambda: {
            'model': _model_state(module_a, dp_rank, copies=True),
            'optimizer': opt_a.sharded_state_dict(
                _model_state(module_a, dp_rank), metadata=metadata
            ),
        }
    )
    if not failed:
        result['save_error'] = _save(ctx, state, ckpt)
        failed = _any(result['save_error'])
    if not failed and ctx.rank == 0:
        # Where the distributed optimizer's per-bucket lists went: the common (rank 0) state.
        common = dist_checkpointing.load_common_state_dict(ckpt)
        result['common_param_state'] = _find_key(common, 'param_state')
    if not failed and case.get('check_content'):
        result['content_wrong'] = _content_wrong(opt_a, module_a, case, ckpt)
    return module_a, ddp_a, opt_a, ckpt, failed


def _run_b(case, dp_rank, metadata, ckpt, result):
    """Run B: another seed, ``load_steps`` steps of its own (0: fresh), then the load.

    Returns (module, ddp, optimizer), or None with result['load_stage'] set if the load failed.
    """
    from megatron.core import dist_checkpointing

    module_b, ddp_b, opt_b = _build(case, seed=23)
    for step in range(case.get('load_steps', 0)):
        _step(module_b, ddp_b, opt_b, 100 + step)
    state, result['load_error'], failed = _stage(
        lambda: {
            'model': _model_state(module_b, dp_rank, copies=True),
            'optimizer': opt_b.sharded_state_dict(
                _model_state(module_b, dp_rank), is_loading=True, metadata=metadata
            ),
        }
    )
    if failed:
        result['load_stage'] = 'sharded_state_dict'
        return None

    def load():
        loaded = dist_checkpointing.load(state, ckpt)
        with torch.no_grad():
            for name, param in module_b.named_parameters():
                param.copy_(loaded['model'][name])
        opt_b.load_state_dict(loaded['optimizer'])

    _, result['load_error'], failed = _stage(load)
    if failed:
        result['load_stage'] = 'load'
        return None
    return module_b, ddp_b, opt_b


def _next_step(case, run_a, run_b, result):
    """Both runs take the next step on the same gradients.

    The resumed run (B) should then be the run that never stopped (A).
    """
    (module_a, ddp_a, opt_a), (module_b, ddp_b, opt_b) = run_a, run_b
    _step(module_a, ddp_a, opt_a, case['steps'])
    _step(module_b, ddp_b, opt_b, case['steps'])
    diffs = [
        float((a.double() - b.double()).abs().max())
        for a, b in zip(module_a.parameters(), module_b.parameters())
    ]
    result['next_step_max_diff'] = max(diffs)
    result['next_step_equal'] = all(
        torch.equal(a, b) for a, b in zip(module_a.parameters(), module_b.parameters())
    )
    result['step_a_next'], result['step_b_next'] = _step_state(opt_a), _step_state(opt_b)


def _round_trip(ctx, case, root):
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    metadata = _metadata(case)
    result = {'name': case['name'], 'save_error': None, 'load_error': None}

    module_a, ddp_a, opt_a, ckpt, failed = _run_a(ctx, case, root, dp_rank, metadata, result)
    if failed:
        result['files'] = sorted(os.listdir(ckpt))
        return result

    run_b = _run_b(case, dp_rank, metadata, ckpt, result)
    if run_b is None:
        return result
    opt_b = run_b[2]

    result['mismatches'] = _compare(_states(opt_a), _states(opt_b))
    result['step_a'], result['step_b'] = _step_state(opt_a), _step_state(opt_b)
    _next_step(case, (module_a, ddp_a, opt_a), run_b, result)
    return result


def _content_wrong(optimizer, module, case, ckpt):
    """Names of the params whose main param in the checkpoint is not the model param's value.

    Every rank reads the whole checkpointed main-param tensors: per model param
    (fully_reshardable) or per bucket, sliced by the buffer's param layout (dp_reshardable). A
    model param is its main param cast to the param's dtype (both saved right after a step).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank = dist.get_rank()
    names = {param: name for name, param in module.named_parameters()}
    wanted, slices = {}, []
    for distopt in _distopts(optimizer):
        for g, buffer in enumerate(distopt.buffers):
            for b, bucket in enumerate(buffer.buckets):
                if case['sharding'] == 'dp_reshardable':
                    dtype = (buffer.param_dtype, buffer.grad_dtype)
                    key = (
                        f'optimizer.distributed.dp_group_idx_{distopt.data_parallel_group_idx}'
                        f'.gbuf_idx_{g}.dtype_{dtype}.bucket_idx_{b}.param'
                    )
                    wanted[key] = bucket.numel_unpadded
                    offset = bucket.offset
                    for param in bucket.params:
                        start, end, _ = buffer.param_index_map[param]
                        slices.append((key, start - offset, end - offset, param))
                else:
                    for param in bucket.params:
                        key = f'optimizer.state.param.model.{names[param]}'
                        wanted[key] = param.numel()
                        slices.append((key, 0, param.numel(), param))
    state = {
        key: ShardedTensor.from_rank_offsets(
            key, torch.empty(numel, dtype=torch.float32), replica_id=(0, 0, rank)
        )
        for key, numel in wanted.items()
    }
    loaded = dist_checkpointing.load(state, ckpt)
    wrong = []
    for key, start, end, param in slices:
        value = loaded[key][start:end].to(param.dtype).reshape(param.shape)
        if not torch.equal(value, param.detach()):
            wrong.append(names[param])
    return sorted(wrong)


def _compare(saved, loaded):
    assert [k for k, _ in saved] == [k for k, _ in loaded]
    mismatches = []
    for (key, a), (_, b) in zip(saved, loaded):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            same_shape = a.shape == b.shape
            mismatches.append(
                {
                    'key': key,
                    'saved': a.item() if a.numel() == 1 else None,
                    'loaded': b.item() if b.numel() == 1 else None,
                    'differ': int((a.double() != b.double()).sum()) if same_shape else -1,
                    'numel': a.numel(),
                }
            )
    return mismatches


def scenario_round_trips(ctx, cases):
    """Candidates 3-6: one result dict per case."""
    return _cases(ctx, cases, _round_trip)
