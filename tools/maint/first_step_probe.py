#!/usr/bin/env python3
"""Run upstream's pretrain_gpt.py (from the current directory) with a probe around train_step.

    PROBE_OUT=probe.json python3 -m torch.distributed.run --nproc_per_node 1 \
        tools/maint/first_step_probe.py <pretrain_gpt.py arguments>

The probe records the CUDA allocator's history from the start and writes, to PROBE_OUT, the live
device allocations (size and the Megatron/torch frames that allocated them) just before the first
real train_step (the warmup's own calls to train_step are counted and skipped) and before the
third one, plus ``torch.cuda.memory_allocated()`` before every call and, at the end, the peaks of
allocated bytes (whole blocks, as ``max_memory_allocated``) and of requested bytes (the tensors'
own sizes, without the allocator's rounding). PROBE_STACKS=0 records the peaks only. Diff two arms
with ``first_step_probe.py --diff A.json B.json``. A diagnostic only: recording stacks slows every
allocation, so its runs are not used for timing.
"""

import collections
import json
import os
import runpy
import sys

KEEP = ('megatron', 'pretrain_gpt', 'torch/optim', 'torch/distributed')


def _live_blocks() -> list:
    import torch

    blocks = []
    for segment in torch.cuda.memory._snapshot()['segments']:
        for block in segment['blocks']:
            if block['state'] != 'active_allocated':
                continue
            frames = [
                f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}"
                for f in block.get('frames', [])
                if any(k in f['filename'] for k in KEEP)
            ]
            blocks.append({'size': block['size'], 'frames': frames[:6]})
    return blocks


def probe() -> None:
    """Install the probe and run pretrain_gpt.py as __main__."""
    import torch

    stacks = os.environ.get('PROBE_STACKS', '1') != '0'
    if stacks:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    from megatron.training import training
    from megatron.training.global_vars import get_args

    real_step, calls, record = training.train_step, [], {'allocated': [], 'snapshots': {}}

    def train_step(*args, **kwargs):
        torch.cuda.synchronize()
        first_real = int(getattr(get_args(), 'warmup_train_steps', 0) or 0)
        record['allocated'].append(torch.cuda.memory_allocated())
        for name, index in (('first_real_step', first_real), ('third_real_step', first_real + 2)):
            if stacks and len(calls) == index:
                record['snapshots'][name] = _live_blocks()
        calls.append(None)
        return real_step(*args, **kwargs)

    training.train_step = train_step
    sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]
    sys.path.insert(0, os.getcwd())  # pretrain_gpt.py imports its neighbours (gpt_builders)
    try:
        runpy.run_path('pretrain_gpt.py', run_name='__main__')
    finally:
        stats = torch.cuda.memory_stats()
        record['peaks'] = {
            key: stats.get(f'{key}_bytes.all.peak') for key in ('allocated', 'requested')
        }
        with open(os.environ['PROBE_OUT'], 'w') as out:
            json.dump(record, out)


def diff(path_a: str, path_b: str) -> None:
    """Print the live allocations that differ between two probe files, per snapshot and stack."""
    a, b = (json.load(open(p)) for p in (path_a, path_b))
    for name, rec in ((path_a, a), (path_b, b)):
        peaks = ', '.join(f'{k} {v / 2**20:.2f}' for k, v in rec.get('peaks', {}).items())
        print(f'peak MB in {name}: {peaks}')
    print('allocated before each call (MB):')
    for name, rec in ((path_a, a), (path_b, b)):
        print(f'  {name}: ' + ' '.join(f'{x / 2**20:.2f}' for x in rec['allocated']))
    for snap in a['snapshots']:
        count = collections.Counter()
        for sign, rec in ((1, a), (-1, b)):
            for block in rec['snapshots'].get(snap, []):
                count[(block['size'], ' <- '.join(block['frames']))] += sign
        print(f'== {snap}: blocks live in {path_a} but not {path_b} (+) and the reverse (-)')
        for (size, stack), n in sorted(count.items(), key=lambda kv: -kv[0][0] * abs(kv[1])):
            if n:
                print(f'  {n:+d} x {size / 2**20:.3f} MB  {stack or "(no Megatron frame)"}')


if __name__ == '__main__':
    if sys.argv[1:2] == ['--diff']:
        diff(sys.argv[2], sys.argv[3])
    else:
        probe()
