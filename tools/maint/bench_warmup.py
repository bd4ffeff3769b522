#!/usr/bin/env python3
"""Benchmark the fork against pristine upstream and the warmup against no warmup, on one device.

One command measures, side by side, for a small GPT built from megatron.core (GPTModel with the
local layer spec, bf16, world size 1, DDP with overlap_grad_reduce and the distributed optimizer,
Adam via get_megatron_optimizer, the no-pipelining schedule, and what train() installs on the
model config, through the function train() calls):

* steady-state step time, fork / pristine (same config; median per run, ratio per repeat);
* first real step time / steady step time, with and without ``run_warmup()`` before it;
* peak device memory (torch.cuda.max_memory_allocated) with and without warmup;
* wall time of the warmup steps plus the restore.

Every arm runs in a fresh subprocess (a cold first step), with its tree first on ``sys.path``;
the worker asserts that ``megatron.core`` was imported from that tree. Repeats interleave the arms
so slow drift of the device (clocks, temperature) hits all arms alike.

Usage:
    python tools/maint/bench_warmup.py --fork-tree . --pristine-tree build/trees/pristine-0.18.2 \
        --out results/bench.json [--layers 12 --hidden 2048 --seq 2048 --accum 2 \
        --micro-batch 1 --repeats 5 --steps 8 --warmup-steps 2]
    # CPU smoke test (tiny sizes, gloo, the test harness's CUDA redirect):
    python tools/maint/bench_warmup.py --device cpu --layers 2 --hidden 64 --seq 32 --vocab 128 \
        --repeats 1 --steps 3 --out /tmp/bench-cpu.json
"""

import argparse
import contextlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_KEEP = contextlib.ExitStack()  # contexts that last as long as the worker process

# name -> (tree key, warmup?)
ARMS = {'pristine': ('pristine', False), 'fork': ('fork', False), 'fork+warmup': ('fork', True)}


# ------------------------------------------------------------------------------------------------
# Worker: one arm, one fresh process.


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _cpu_redirect():
    """On CPU, reuse the test harness's redirect of megatron's torch.cuda calls (smoke only)."""
    sys.path.append(REPO)  # after the tree, so it never shadows megatron

    from tests.harness import cpu_redirect

    cpu_redirect.install()
    # RNG-tracker calls (model_parallel_cuda_manual_seed, the warmup's RNG snapshot, dropout under
    # tracker.fork()): the redirect's pretrain mode stands in for the device RNG, for good.
    _KEEP.enter_context(cpu_redirect.pretrain_mode())


def _synthetic_batches(cfg, seed, device):
    """Endless GPT micro-batches (tokens, labels, loss_mask, position_ids) from a private RNG."""
    import torch

    mbs, seq, vocab = cfg['micro_batch'], cfg['seq'], cfg['vocab']
    gen = torch.Generator().manual_seed(seed)
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(mbs, -1).contiguous()
    position_ids = position_ids.to(device)
    loss_mask = torch.ones(mbs, seq, dtype=torch.float, device=device)
    while True:
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen, dtype=torch.long)
        tokens = tokens.to(device, non_blocking=True)
        yield {
            'tokens': tokens[:, :-1],
            'labels': tokens[:, 1:],
            'loss_mask': loss_mask,
            'position_ids': position_ids,
        }


def _loss_func(loss_mask, output_tensor):
    import torch

    losses = output_tensor.float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses.reshape(-1) * mask) / mask.sum()
    return loss, {'lm loss': loss.detach()}


def _forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    output = model(
        batch['tokens'], batch['position_ids'], attention_mask=None, labels=batch['labels']
    )
    return output, partial(_loss_func, batch['loss_mask'])


def _make_step_fn(cfg):
    """A bare-megatron.core train step with training.train_step()'s signature and return shape."""
    import torch

    shape = {'num_microbatches': cfg['accum'], 'micro_batch_size': cfg['micro_batch']}
    shape.update(seq_length=cfg['seq'], decoder_seq_length=cfg['seq'], forward_only=False)

    def step_fn(*step_args, iteration=None):  # pylint: disable=unused-argument
        # train_step()'s positional arguments; the model config is not needed here.
        forward_step, data, model, optimizer, opt_param_scheduler, _, fb_func = step_args
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fb_func(forward_step_func=forward_step, data_iterator=data, model=model, **shape)
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful and opt_param_scheduler is not None:
            opt_param_scheduler.step(increment=cfg['micro_batch'] * cfg['accum'])
        loss = torch.stack([d['lm loss'] for d in losses]).mean()
        return loss, 0 if update_successful else 1, grad_norm

    return step_fn


def _sync(device):
    import torch

    if device.type == 'cuda':
        torch.cuda.synchronize()


def run_worker(spec):
    """Run one arm in this process; returns the measurements as a dict."""
    cfg, tree, warmup = spec['config'], os.path.realpath(spec['tree']), spec['warmup']
    sys.path.insert(0, tree)
    sys.path.append(REPO)  # tests.scenarios.common; after the tree, so it never shadows megatron
    import torch

    use_cpu = cfg['device'] == 'cpu'
    if use_cpu:
        _cpu_redirect()
        device, backend = torch.device('cpu'), 'gloo'
    else:
        torch.cuda.set_device(0)
        device, backend = torch.device('cuda', 0), 'nccl'

    import megatron.core

    core_file = os.path.realpath(megatron.core.__file__)
    if not core_file.startswith(tree + os.sep):
        raise SystemExit(f'megatron.core was imported from {core_file}, not from the tree {tree}')

    # Every arm imports megatron.training (as pretrain() users do), so module-import side effects
    # are the same with and without the warmup. On CPU, bind the real torch.cuda while importing:
    # a few modules touch torch.cuda attributes at import time only.
    proxy = torch.cuda
    if use_cpu:
        from tests.harness import cpu_redirect

        torch.cuda = cpu_redirect._REAL_CUDA
    try:
        import megatron.training.training  # noqa: F401
    finally:
        torch.cuda = proxy

    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group(
        backend=backend, init_method=f'tcp://127.0.0.1:{_free_port()}', rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(cfg['seed'])
    model_parallel_cuda_manual_seed(cfg['seed'])

    heads = cfg['heads'] or max(1, cfg['hidden'] // 128)
    config = TransformerConfig(
        num_layers=cfg['layers'],
        hidden_size=cfg['hidden'],
        num_attention_heads=heads,
        ffn_hidden_size=4 * cfg['hidden'],
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=cfg['dropout'],
        attention_dropout=cfg['dropout'],
        use_cpu_initialization=use_cpu,
    )
    config.timers = None
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=cfg['vocab'],
        max_sequence_length=cfg['seq'],
    )
    model.to(device)
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=cfg['bucket_size']
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam',
            lr=1e-4,
            min_lr=1e-5,
            weight_decay=0.01,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-4,
        min_lr=1e-5,
        lr_warmup_steps=10,
        lr_decay_steps=1000,
        lr_decay_style='cosine',
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=1000,
        wd_incr_style='constant',
    )
    from tests.scenarios.common import install_train_loop_hooks, train_loop_args

    # The args train() reads for this set-up (pretrain()'s defaults for this configuration).
    args = train_loop_args(use_distributed_optimizer=True)
    model.train()
    chunks = [model]
    forward_backward_func = get_forward_backward_func()
    step_fn = _make_step_fn(cfg)
    _sync(device)
    mem = device.type == 'cuda'
    out = {
        'tree': tree,
        'megatron_core_file': core_file,
        'num_parameters': sum(p.numel() for p in model.parameters()),
        'allocated_after_setup_bytes': torch.cuda.memory_allocated() if mem else None,
    }

    # What train() installs before its loop: the function train() calls (a pristine tree lacks
    # it; the helper compiles the same function from this base's patch, FORK_TEST_BASE selects
    # the base). The warmup runs right after it, as in train().
    param_sync_func = install_train_loop_hooks(chunks, optimizer, config, args)
    if warmup:
        from megatron.training.warmup import run_warmup

        warm_iter = _synthetic_batches(cfg, cfg['seed'] + 9973, device)
        t0 = time.perf_counter()
        report = run_warmup(
            step_fn,
            _forward_step,
            chunks,
            optimizer,
            scheduler,
            config,
            param_sync_func,
            cfg['warmup_steps'],
            data_iterator=warm_iter,
            args=args,
        )
        _sync(device)
        out['warmup_wall_s'] = time.perf_counter() - t0
        out['warmup_report'] = {
            'num_steps': report.num_steps,
            'seconds': report.seconds,
            'host_staging_bytes': report.host_staging_bytes,
            'bucket_groups_reset': report.bucket_groups_reset,
            'collectives_drained': report.collectives_drained,
            'losses': [float(x) for x in report.losses],
            'step_seconds': report.step_seconds,
            'one_time_cost': report.one_time_cost,
        }
    if mem:
        out['allocated_before_first_step_bytes'] = torch.cuda.memory_allocated()
        out['peak_before_first_step_bytes'] = torch.cuda.max_memory_allocated()

    data = _synthetic_batches(cfg, cfg['seed'], device)
    times, losses, skipped = [], [], 0
    for _ in range(cfg['steps']):
        _sync(device)
        t0 = time.perf_counter()
        loss, skip, _ = step_fn(
            _forward_step,
            data,
            chunks,
            optimizer,
            scheduler,
            config,
            forward_backward_func,
            iteration=len(times),
        )
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        skipped += skip
    out['step_times_s'] = times
    out['losses'] = losses
    out['skipped_steps'] = skipped
    out['first_step_s'] = times[0]
    steady = times[cfg['steady_skip'] :] or times[1:] or times
    out['steady_step_s'] = statistics.median(steady)
    out['first_over_steady'] = times[0] / out['steady_step_s']
    if mem:
        out['peak_allocated_bytes'] = torch.cuda.max_memory_allocated()
        out['peak_reserved_bytes'] = torch.cuda.max_memory_reserved()
    dist.barrier()
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------------------
# Driver.


def _run(cmd, timeout=30):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return proc.stdout.strip() if proc.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device):
    """GPU name, driver, torch/CUDA/HIP versions, host facts."""
    import torch

    env = {
        'python': platform.python_version(),
        'torch': torch.__version__,
        'cuda_runtime': torch.version.cuda,
        'hip_runtime': getattr(torch.version, 'hip', None),
        'host': platform.node(),
        'cpu_count': os.cpu_count(),
        'device': device,
        'gpu_name': None,
        'gpu_count': 0,
        'gpu_memory_bytes': None,
        'driver': None,
    }
    if device == 'cuda':
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu_name=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_bytes=props.total_memory,
        )
        driver = _run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'])
        if driver is None and env['hip_runtime']:
            driver = _run(['rocm-smi', '--showdriverversion'])
        env['driver'] = driver.splitlines()[0].strip() if driver else None
    env['repo_commit'] = _run(['git', '-C', REPO, 'rev-parse', 'HEAD'])
    env['fork_base'], env['patch_series'] = _fork_series()
    return env


def _fork_series():
    """(base, series entries) of the repository's materialized megatron/ ((None, None) if none)."""
    sys.path.insert(0, os.path.join(REPO, 'tools'))
    try:
        from megatron_fork import ForkError, series  # pylint: disable=import-outside-toplevel
        from megatron_fork.workspace import Workspace  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.remove(os.path.join(REPO, 'tools'))
    ws = Workspace(REPO)
    base = ws.base()
    try:
        return base, series.read_series(ws.patch_dir(base)) if base else None
    except ForkError:
        return base, None


def _spread(values):
    if not values:
        return None
    return {
        'median': statistics.median(values),
        'min': min(values),
        'max': max(values),
        'n': len(values),
        'values': values,
    }


def _median_key(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return _spread(values)


def summarize(results, repeats):
    """Per-arm medians and the paired ratios (repeat i of one arm against repeat i of another)."""
    summary = {'arms': {}}
    for arm, runs in results.items():
        summary['arms'][arm] = {
            key: _median_key(runs, key)
            for key in (
                'first_step_s',
                'steady_step_s',
                'first_over_steady',
                'peak_allocated_bytes',
                'peak_reserved_bytes',
                'allocated_before_first_step_bytes',
                'warmup_wall_s',
            )
        }
        summary['arms'][arm]['skipped_steps'] = sum(r['skipped_steps'] for r in runs)

    def paired(num_arm, den_arm, key):
        num, den = results.get(num_arm, []), results.get(den_arm, [])
        values = [
            a[key] / b[key] for a, b in zip(num, den) if a.get(key) is not None and b.get(key)
        ]
        return _spread(values)

    summary['ratios'] = {
        'steady_fork_over_pristine': paired('fork', 'pristine', 'steady_step_s'),
        'steady_forkwarmup_over_fork': paired('fork+warmup', 'fork', 'steady_step_s'),
        'peak_forkwarmup_over_fork': paired('fork+warmup', 'fork', 'peak_allocated_bytes'),
        'peak_fork_over_pristine': paired('fork', 'pristine', 'peak_allocated_bytes'),
    }
    num, den = results.get('fork+warmup', []), results.get('fork', [])
    key = 'allocated_before_first_step_bytes'
    summary['allocated_before_first_step_forkwarmup_minus_fork_bytes'] = _spread(
        [a[key] - b[key] for a, b in zip(num, den) if a.get(key) is not None and b.get(key)]
    )
    # Exact restore: the real steps after the warmup see the same losses as without it.
    fork, warm = results.get('fork', []), results.get('fork+warmup', [])
    diffs = [max(abs(x - y) for x, y in zip(a['losses'], b['losses'])) for a, b in zip(fork, warm)]
    summary['max_abs_loss_diff_fork_vs_forkwarmup'] = max(diffs) if diffs else None
    # Run-to-run noise of one arm, for comparison (non-deterministic GPU kernels).
    noise = [max(abs(x - y) for x, y in zip(fork[0]['losses'], b['losses'])) for b in fork[1:]]
    summary['max_abs_loss_diff_between_fork_repeats'] = max(noise) if noise else None
    summary['repeats'] = repeats
    return summary


def _fmt(spread, scale=1.0, digits=3, unit=''):
    if not spread:
        return '-'
    med = spread['median'] * scale
    lo, hi = spread['min'] * scale, spread['max'] * scale
    return f'{med:.{digits}f}{unit} [{lo:.{digits}f}-{hi:.{digits}f}]'


def table(summary):
    """Short human-readable table (median [min-max] over repeats)."""
    gib = 1.0 / 2**30
    lines = [
        f'{"arm":<12} {"first step s":>22} {"steady step s":>22} {"first/steady":>20} '
        f'{"peak GiB":>20} {"warmup s":>18}'
    ]
    for arm, s in summary['arms'].items():
        lines.append(
            f'{arm:<12} {_fmt(s["first_step_s"], digits=4):>22} '
            f'{_fmt(s["steady_step_s"], digits=4):>22} '
            f'{_fmt(s["first_over_steady"], digits=2):>20} '
            f'{_fmt(s["peak_allocated_bytes"], gib, 2):>20} '
            f'{_fmt(s["warmup_wall_s"], digits=2):>18}'
        )
    r = summary['ratios']
    lines.append(f'steady fork/pristine:        {_fmt(r["steady_fork_over_pristine"], digits=4)}')
    lines.append(f'steady fork+warmup/fork:     {_fmt(r["steady_forkwarmup_over_fork"], digits=4)}')
    lines.append(f'peak fork+warmup/fork:       {_fmt(r["peak_forkwarmup_over_fork"], digits=4)}')
    lines.append(f'peak fork/pristine:          {_fmt(r["peak_fork_over_pristine"], digits=4)}')
    lines.append(
        f'max |loss diff| fork vs fork+warmup (0 on CPU; GPU atomics may add noise): '
        f'{summary["max_abs_loss_diff_fork_vs_forkwarmup"]} (between fork repeats: '
        f'{summary["max_abs_loss_diff_between_fork_repeats"]})'
    )
    return '\n'.join(lines)


def _launch(spec, timeout):
    with tempfile.TemporaryDirectory(prefix='bench-warmup-') as work:
        spec_path = os.path.join(work, 'spec.json')
        out_path = os.path.join(work, 'out.json')
        with open(spec_path, 'w') as f:
            json.dump(spec, f)
        env = dict(os.environ)
        env.setdefault('PYTHONWARNINGS', 'ignore')
        if spec['config']['device'] == 'cpu':
            env['CUDA_VISIBLE_DEVICES'] = ''
        # The script's directory (tools/maint/) is sys.path[0]; nothing else may shadow the tree.
        env.pop('PYTHONPATH', None)
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), '--worker', spec_path, out_path],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=REPO,
        )
        wall = time.monotonic() - start
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (proc.stdout[-3000:] + '\n' + proc.stderr[-6000:]).strip()
            raise RuntimeError(f'arm {spec["arm"]} failed (rc {proc.returncode}):\n{tail}')
        with open(out_path) as f:
            result = json.load(f)
        result['process_wall_s'] = wall
        return result


def parse_args(argv=None):
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--fork-tree', default='.', help='directory containing the fork megatron/')
    p.add_argument(
        '--pristine-tree',
        default='build/trees/pristine-0.18.2',
        help='directory containing pristine megatron/ (tools/fork.py pristine 0.18.2)',
    )
    p.add_argument('--out', required=True, help='JSON output path')
    p.add_argument('--device', choices=('auto', 'cuda', 'cpu'), default='auto')
    p.add_argument('--layers', type=int, default=12)
    p.add_argument('--hidden', type=int, default=2048)
    p.add_argument('--heads', type=int, default=0, help='attention heads (0: hidden // 128)')
    p.add_argument('--seq', type=int, default=2048)
    p.add_argument('--vocab', type=int, default=32768)
    p.add_argument('--accum', type=int, default=2, help='micro-batches per step')
    p.add_argument('--micro-batch', type=int, default=1)
    p.add_argument('--dropout', type=float, default=0.1)
    p.add_argument('--bucket-size', type=int, default=None, help='DDP bucket size (elements)')
    p.add_argument('--repeats', type=int, default=5, help='fresh processes per arm')
    p.add_argument('--steps', type=int, default=8, help='real steps per process')
    p.add_argument(
        '--steady-skip', type=int, default=2, help='steps excluded from the steady-state median'
    )
    p.add_argument('--warmup-steps', type=int, default=2, help='run_warmup num_steps (2-3)')
    p.add_argument('--seed', type=int, default=1234)
    p.add_argument(
        '--arms', default=','.join(ARMS), help='comma-separated subset of ' + str(list(ARMS))
    )
    p.add_argument('--timeout', type=float, default=600, help='seconds per arm process')
    p.add_argument(
        '--max-seconds',
        type=float,
        default=0,
        help='start no further repeat once the next one would pass this many seconds (0: off)',
    )
    p.add_argument('--label', default='', help='free-text label stored in the JSON')
    return p.parse_args(argv)


def main(argv=None):
    """Run every arm ``--repeats`` times, print the table and write the JSON."""
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == '--worker':
        with open(argv[1]) as f:
            spec = json.load(f)
        result = run_worker(spec)
        with open(argv[2], 'w') as f:
            json.dump(result, f)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (NCCL/allocator) so it cannot hang or skew

    args = parse_args(argv)
    import torch

    device = args.device
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: no CUDA/ROCm device visible to torch')
    trees = {}
    for key, path in (('fork', args.fork_tree), ('pristine', args.pristine_tree)):
        if not os.path.isabs(path) and not os.path.isdir(os.path.join(path, 'megatron', 'core')):
            path = os.path.join(REPO, path)  # relative to the repository root
        path = os.path.realpath(path)
        if not os.path.isdir(os.path.join(path, 'megatron', 'core')):
            hint = (
                'python tools/fork.py materialize'
                if key == 'fork'
                else 'python tools/fork.py pristine 0.18.2'
            )
            raise SystemExit(f'--{key}-tree {path} has no megatron/core (create it: {hint})')
        trees[key] = path
    arms = [a.strip() for a in args.arms.split(',') if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f'unknown arms {unknown}; choose from {list(ARMS)}')
    if any(ARMS[a][1] for a in arms) and not os.path.exists(
        os.path.join(trees['fork'], 'megatron', 'training', 'warmup.py')
    ):
        raise SystemExit(f'{trees["fork"]}/megatron/training/warmup.py missing: not a fork tree')
    cfg = {
        'device': device,
        'layers': args.layers,
        'hidden': args.hidden,
        'heads': args.heads or max(1, args.hidden // 128),
        'seq': args.seq,
        'vocab': args.vocab,
        'accum': args.accum,
        'micro_batch': args.micro_batch,
        'dropout': args.dropout,
        'bucket_size': args.bucket_size,
        'steps': args.steps,
        'steady_skip': args.steady_skip,
        'warmup_steps': args.warmup_steps,
        'seed': args.seed,
        'dtype': 'bf16',
        'model': 'GPTModel(get_gpt_layer_local_spec()), learned_absolute positions',
        'parallel': 'world 1 (TP1 PP1 DP1), DDP overlap_grad_reduce + distributed optimizer',
        'optimizer': 'adam (get_megatron_optimizer), clip_grad 1.0, cosine scheduler',
    }
    command = ' '.join(shlex.quote(x) for x in ['python', os.path.relpath(__file__, REPO), *argv])
    print(f'bench_warmup: {command}', flush=True)
    results = {arm: [] for arm in arms}
    errors, done = [], 0
    t_start = time.monotonic()
    for rep in range(args.repeats):
        order = arms[rep % len(arms) :] + arms[: rep % len(arms)]  # rotate to spread drift
        for arm in order:
            tree_key, warmup = ARMS[arm]
            spec = {'arm': arm, 'tree': trees[tree_key], 'warmup': warmup, 'config': cfg}
            try:
                res = _launch(spec, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors.append({'arm': arm, 'repeat': rep, 'error': str(exc)[-4000:]})
                print(f'  repeat {rep} {arm:<12} FAILED: {str(exc)[-2000:]}', flush=True)
                continue
            res['repeat'] = rep
            results[arm].append(res)
            print(
                f'  repeat {rep} {arm:<12} first {res["first_step_s"]:.4f}s steady '
                f'{res["steady_step_s"]:.4f}s first/steady {res["first_over_steady"]:.2f}'
                + (
                    f' peak {res["peak_allocated_bytes"] / 2**30:.2f}GiB'
                    if res.get('peak_allocated_bytes')
                    else ''
                )
                + (f' warmup {res["warmup_wall_s"]:.2f}s' if 'warmup_wall_s' in res else '')
                + f' (process {res["process_wall_s"]:.1f}s)',
                flush=True,
            )
        done = rep + 1
        elapsed = time.monotonic() - t_start
        if done < args.repeats:
            _write(args, command, device, trees, cfg, results, errors, done, elapsed)
            if args.max_seconds and elapsed * (done + 1) / done > args.max_seconds:
                print(
                    f'  stopping after {done} repeats: another would pass --max-seconds '
                    f'{args.max_seconds:g}',
                    flush=True,
                )
                break
    payload = _write(
        args, command, device, trees, cfg, results, errors, done, time.monotonic() - t_start
    )
    summary, out = payload['summary'], payload['out']
    env = payload['environment']
    print(
        f'\n{env["gpu_name"] or "CPU"} | driver {env["driver"]} | torch {env["torch"]} | '
        f'{cfg["layers"]}L h{cfg["hidden"]} s{cfg["seq"]} mbs{cfg["micro_batch"]} '
        f'accum{cfg["accum"]} | {args.repeats} repeats x {args.steps} steps'
    )
    print(table(summary))
    for err in errors:
        print(f'FAILED: {err["arm"]} repeat {err["repeat"]}')
    print(f'wrote {out}')
    return 1 if errors else 0


def _write(args, command, device, trees, cfg, results, errors, repeats_done, wall):
    """Write the JSON (after every repeat, so a run cut short still leaves its data)."""
    summary = summarize(results, repeats_done)
    payload = {
        'schema': 'bench_warmup/1',
        'label': args.label,
        'command': command,
        'created_unix': time.time(),
        'python_executable': sys.executable,
        'cwd': os.getcwd(),
        'complete': repeats_done == args.repeats and not errors,
        'errors': errors,
        'bench_wall_s': wall,
        'environment': environment(device),
        'trees': trees,
        'config': cfg,
        'summary': summary,
        'runs': results,
    }
    out = args.out if os.path.isabs(args.out) else os.path.join(os.getcwd(), args.out)
    os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
    tmp = out + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, out)
    payload['out'] = out
    return payload


if __name__ == '__main__':
    sys.exit(main())
