"""Issue 30, candidate 7: the CPU-offload optimizer (HybridDeviceOptimizer) through the real path.

One process, one GPU (world 1, NCCL). ``PYTHONPATH=<tree>:<repo>`` selects the megatron tree.
Every case builds a DistributedDataParallel model (distributed optimizer) and its optimizer with
``get_megatron_optimizer(OptimizerConfig(optimizer_cpu_offload=True, bf16=True, ...))`` and
compares two arms of the same run bitwise:

- ``finetune``: a model-only checkpoint (``dist_checkpointing.save`` of the model params) is
  loaded after the optimizer is built, then ``optimizer.reload_model_params()`` (what
  ``load_checkpoint`` does with ``--no-load-optim``/``--finetune``). Arm R builds the same model,
  puts the loaded weights in before DDP and the optimizer exist. Arm S never loads (the stale
  init). After each of two steps the model params of the loading arm are compared with R and S.
- ``resume``: run A takes 3 steps and saves model + ``optimizer.sharded_state_dict`` (dp_reshardable
  or fully_reshardable); run B (another seed; a fresh optimizer, or one stepped once on other
  gradients) loads it as ``load_checkpoint`` does (template with ``is_loading=True``,
  ``dist_checkpointing.load``, model params, ``optimizer.load_state_dict``). Adam's per-param
  ``step`` of B's sub-optimizers after the load is compared with A's (3), then A (the run that
  never stopped) and B take two more steps on the same gradients and the model params are
  compared.

``layout='te'`` runs the distributed optimizer's TE/apex branches (``HAVE_APEX_OR_TE``) with every
param offloaded (so no GPU sub-optimizer, which would be TE's FusedAdam, is built).

Writes one JSON line per case to stdout (prefix ``CASE ``) and all of them to ``--out``.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

SIZES = [2048, 64, 130, 2048]  # offload fraction 0.5 splits them between CPU and GPU
FP32_INDEX = 1  # with fp32=True this param stays fp32 (a bf16 model with one fp32 param)


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )


def _module(config, seed, fp32):
    from megatron.core.transformer.module import MegatronModule

    class Params(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            gen = torch.Generator().manual_seed(seed)
            self.p = torch.nn.ParameterList()
            for i, n in enumerate(SIZES):
                dtype = torch.float32 if (fp32 and i == FP32_INDEX) else torch.bfloat16
                self.p.append(torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype).cuda()))

    return Params()


def _build(case, seed, weights=None):
    """Module (optionally overwritten by ``weights`` before DDP), DDP, get_megatron_optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = _config()
    module = _module(config, seed, case.get('fp32', False))
    if weights is not None:
        with torch.no_grad():
            for name, param in module.named_parameters():
                param.copy_(weights[name])
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=True, bucket_size=None
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    opt_config = OptimizerConfig(
        optimizer='adam',
        lr=1e-2,
        min_lr=1e-3,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=case['pa'],
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=case['frac'],
        overlap_cpu_optimizer_d2h_h2d=case.get('overlap', False),
        clip_grad=0.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return module, ddp, optimizer


def _step(module, ddp, optimizer, step):
    """One optimizer step on gradients seeded by ``step`` only (equal in every arm)."""
    gen = torch.Generator().manual_seed(7919 + step)
    ddp.zero_grad_buffer()
    for param in module.parameters():
        param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=gen).cuda())
    ok, _, _ = optimizer.step()
    assert ok


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _hdo(optimizer):
    opt = optimizer
    if hasattr(opt, 'chained_optimizers'):
        assert len(opt.chained_optimizers) == 1
        opt = opt.chained_optimizers[0]
    return opt, opt.optimizer


def _steps(optimizer):
    """Adam's per-param step of every sub-optimizer: values and number of distinct tensors."""
    _, hdo = _hdo(optimizer)
    values, ids = [], set()
    for sub in hdo.sub_optimizers:
        for state in sub.state.values():
            if 'step' in state:
                values.append(float(state['step']))
                ids.add(id(state['step']))
    return {'values': values, 'distinct_tensors': len(ids)}


def _split(optimizer):
    """How many of the HybridDeviceOptimizer's params are offloaded (CPU) and kept (GPU)."""
    _, hdo = _hdo(optimizer)
    cpu = len(hdo.gpu_params_map_cpu_copy)
    return {'cpu': cpu, 'gpu': sum(len(g['params']) for g in hdo.param_groups) - cpu}


def _state_devices(optimizer):
    """Per sub-optimizer (gpu: the GPU one): its params' devices and its state tensors' devices."""
    _, hdo = _hdo(optimizer)
    out = []
    for sub in hdo.sub_optimizers:
        params = {str(p.device) for g in sub.param_groups for p in g['params']}
        states = {
            f'{k}:{v.device}'
            for st in sub.state.values()
            for k, v in st.items()
            if isinstance(v, torch.Tensor)
        }
        out.append(
            {'gpu': sub is hdo.gpu_optimizer, 'params': sorted(params), 'state': sorted(states)}
        )
    return out


def _compare(a, b):
    """Bitwise comparison of two param dicts: names that differ and the max abs difference."""
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    diff = max(((a[n].float() - b[n].float()).abs().max().item() for n in differ), default=0.0)
    return {'equal': not differ, 'differ': differ, 'max_abs_diff': diff}


def _model_sharded(module, copies):
    from megatron.core.dist_checkpointing import ShardedTensor

    return {
        name: ShardedTensor.from_rank_offsets(
            f'model.{name}', param.detach().clone() if copies else param, replica_id=(0, 0, 0)
        )
        for name, param in module.named_parameters()
    }


@contextlib.contextmanager
def _layout(kind):
    """'torch': as installed (no apex/TE on the device). 'te': the distributed optimizer's
    apex/TE branches, as with TE installed (only with every param offloaded)."""
    from megatron.core.optimizer import distrib_optimizer

    if kind == 'torch':
        yield
        return
    saved = (distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER)
    distrib_optimizer.HAVE_APEX_OR_TE = True
    distrib_optimizer.USING_TE_OPTIMIZER = True
    try:
        yield
    finally:
        distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = saved


def _error(exc):
    tb = traceback.extract_tb(exc.__traceback__)
    where = [f'{os.path.basename(f.filename)}:{f.lineno} {f.name}' for f in tb[-3:]]
    return {'type': type(exc).__name__, 'message': str(exc)[:400], 'where': where}


def case_finetune(case, root):
    """Model-only load after the optimizer exists, then reload_model_params()."""
    from megatron.core import dist_checkpointing

    result = {}
    # The checkpoint: a model with other weights (seed 11), saved model-only.
    src, _, _ = _build(case, seed=11)
    ckpt = os.path.join(root, 'model')
    os.makedirs(ckpt)
    dist_checkpointing.save(_model_sharded(src, copies=True), ckpt)
    loaded_weights = _params(src)
    del src

    # Arm F: optimizer built from the seed-22 init, then the model-only load.
    module, ddp, optimizer = _build(case, seed=22)
    loaded = dist_checkpointing.load(_model_sharded(module, copies=True), ckpt)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(loaded[name])
    result['split'] = _split(optimizer)
    optimizer.reload_model_params()
    result['model_after_load_equals_checkpoint'] = _compare(_params(module), loaded_weights)[
        'equal'
    ]
    # Arm R: weights in before DDP/optimizer.  Arm S: never loaded (stale init).
    ref = _build(case, seed=22, weights=loaded_weights)
    stale = _build(case, seed=22)
    for step in (1, 2):
        for m, d, o in ((module, ddp, optimizer), ref, stale):
            _step(m, d, o, step)
        f_params = _params(module)
        result[f'step{step}_vs_reference'] = _compare(f_params, _params(ref[0]))
        result[f'step{step}_vs_never_loaded'] = _compare(f_params, _params(stale[0]))
    return result


def case_resume(case, root):
    """Save after 3 steps, load into another run as load_checkpoint does, 2 more steps."""
    from megatron.core import dist_checkpointing

    metadata = {'distrib_optim_sharding_type': case['sharding']}
    if case['sharding'] == 'fully_reshardable':
        metadata['distrib_optim_fully_reshardable_mem_efficient'] = False
    result = {}
    a_module, a_ddp, a_opt = _build(case, seed=11)
    for step in (1, 2, 3):
        _step(a_module, a_ddp, a_opt, step)
    result['saved_steps'] = _steps(a_opt)
    result['split'] = _split(a_opt)
    ckpt = os.path.join(root, 'full')
    os.makedirs(ckpt)
    state = {
        'model': _model_sharded(a_module, copies=True),
        'optimizer': a_opt.sharded_state_dict(
            _model_sharded(a_module, copies=False), metadata=metadata
        ),
    }
    dist_checkpointing.save(state, ckpt)
    del state

    b_module, b_ddp, b_opt = _build(case, seed=22)
    for step in range(case['load_steps']):
        _step(b_module, b_ddp, b_opt, 5000 + step)
    stage = 'template'
    try:
        template = {
            'model': _model_sharded(b_module, copies=True),
            'optimizer': b_opt.sharded_state_dict(
                _model_sharded(b_module, copies=False), is_loading=True, metadata=metadata
            ),
        }
        stage = 'load'
        loaded = dist_checkpointing.load(template, ckpt)
        with torch.no_grad():
            for name, param in b_module.named_parameters():
                param.copy_(loaded['model'][name])
        stage = 'load_state_dict'
        b_opt.load_state_dict(loaded['optimizer'])
    except Exception as exc:  # noqa: BLE001  (the symptom is the result)
        traceback.print_exc()
        result['error'] = {'stage': stage, **_error(exc)}
        return result
    result['loaded_steps'] = _steps(b_opt)
    result['state_devices_after_load'] = _state_devices(b_opt)
    result['model_after_load'] = _compare(_params(b_module), _params(a_module))
    for step in (4, 5):
        _step(a_module, a_ddp, a_opt, step)
        try:
            _step(b_module, b_ddp, b_opt, step)
        except Exception as exc:  # noqa: BLE001  (the symptom is the result)
            traceback.print_exc()
            result['error'] = {'stage': f'step{step}', **_error(exc)}
            return result
        result[f'step{step}_vs_never_stopped'] = _compare(_params(b_module), _params(a_module))
        result[f'steps_after_step{step}'] = _steps(b_opt)
    return result


def cases():
    out = []
    for pa in (True, False):
        for frac in (0.0, 0.5, 1.0):
            out.append(dict(kind='finetune', pa=pa, frac=frac, fp32=False, layout='torch'))
        out.append(dict(kind='finetune', pa=pa, frac=1.0, fp32=True, layout='torch'))
    out.append(dict(kind='finetune', pa=True, frac=1.0, fp32=False, overlap=True, layout='torch'))
    # The torch layout over every precision-aware setting and offload fraction; the TE layout
    # (precision-aware, everything offloaded) once per sharding and loader.
    grid = [(pa, frac, 'torch') for pa in (True, False) for frac in (0.0, 0.5, 1.0)]
    grid.append((True, 1.0, 'te'))
    for pa, frac, layout in grid:
        for sharding in ('dp_reshardable', 'fully_reshardable'):
            for load_steps in (0, 1):
                out.append(
                    dict(
                        kind='resume',
                        pa=pa,
                        frac=frac,
                        sharding=sharding,
                        load_steps=load_steps,
                        layout=layout,
                    )
                )
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--tree-label', required=True)
    parser.add_argument('-k', default=None, help='run only cases whose name contains this')
    parser.add_argument('--cpu-smoke', action='store_true', help='gloo + CUDA-on-CPU redirect')
    args = parser.parse_args()

    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', '29531')
    if args.cpu_smoke:  # only to check this script's own code; no CUDA there
        from tests.harness import cpu_redirect

        cpu_redirect.install()
        dist.init_process_group('gloo', rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        dist.init_process_group('nccl', rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    import megatron.core
    from megatron.core.optimizer import distrib_optimizer

    header = {
        'tree': args.tree_label,
        'megatron_file': megatron.core.__file__,
        'torch': torch.__version__,
        'device': 'cpu-smoke' if args.cpu_smoke else torch.cuda.get_device_name(0),
        'HAVE_APEX_OR_TE': distrib_optimizer.HAVE_APEX_OR_TE,
    }
    print('HEADER ' + json.dumps(header), flush=True)
    results = []
    for case in cases():
        name = '-'.join(f'{k}={v}' for k, v in case.items())
        if args.k and args.k not in name:
            continue
        root = tempfile.mkdtemp(prefix='offload-')
        try:
            with _layout(case['layout']):
                fn = case_finetune if case['kind'] == 'finetune' else case_resume
                torch.manual_seed(0)
                result = fn(case, root)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            result = {'error': {'stage': 'case', **_error(exc)}}
        finally:
            shutil.rmtree(root, ignore_errors=True)
        record = {'tree': args.tree_label, 'case': case, 'name': name, 'result': result}
        results.append(record)
        print('CASE ' + json.dumps(record), flush=True)
    with open(args.out, 'w') as f:
        json.dump({'header': header, 'cases': results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == '__main__':
    sys.exit(main())
