"""Megatron-FSDP gradient accumulation into a grad buffer whose DP group has one rank
(Megatron-LM issue 6660).

Such a buffer is not sharded, so the microbatches' gradients accumulate in it; under
``optim_grads_params`` the tree reduces after every backward, and each reduction acts on the
accumulated sum: a scaling factor != 1 (an expert buffer at EP = DP) rescales the early
microbatches again, and a custom grad comm dtype adds the reduced copy of the buffer to itself.

What runs is the tree's own ``fully_shard_model`` (MegatronFSDP, its hooks, buffers and reduce
pipeline) in a world of one rank: a two-block MLP, N microbatches with ``no_sync()`` on all but
the last (as Megatron's schedules do), then ``finish_grad_sync()``. The accumulated main grads
are compared with the float64 sum of the per-microbatch grads of an identical plain-torch copy,
and with the float32 eager copy's distance from that sum (the bound of the fork arm).
Stood in, for CPU: the redirect's ``megatron_fsdp_mode()`` (``torch.cuda.current_device()`` -> 0:
megatron_fsdp formats ``cuda:{index}``; the pretrain-mode redirects such as ``empty_cache``).
Gloo has no PREMUL_SUM, so the cases that need the tree to pick it set
``gradient_reduce_div_fusion=False`` (unfused mul_ + SUM); cases with ``div_fusion=True`` keep the
default and only run where a one-rank reduction scales explicitly. A scale of 0.5 on the
one-rank group stands for the expert buffer at EP = DP = 2.
"""

import contextlib

import torch

HID = 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(HID, HID, bias=True)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b0 = Block()
        self.b1 = Block()

    def forward(self, x):
        return self.b1(self.b0(x))


def _data(k, dtype):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(4, HID, generator=g).to(dtype=dtype)


def _eager(n_micro, dtype):
    torch.manual_seed(1234)
    net = Net().to(dtype)
    for k in range(n_micro):
        net(_data(k, dtype)).sum().backward()
    return {n: p.grad.detach().double() for n, p in net.named_parameters()}


def _flat(grads, names):
    return torch.cat([grads[n].reshape(-1) for n in names])


def _run(case):
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    from megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision import (
        MixedPrecisionPolicy,
    )

    fs = importlib.import_module('megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard')
    n_micro, cycles = case['n_micro'], case.get('cycles', 1)
    bf16 = {None: None, 'fp32': torch.float32, 'bf16': torch.bfloat16}
    mesh = init_device_mesh('cpu', (1, 1), mesh_dim_names=('fsdp', 'tp'))
    torch.manual_seed(1234)
    model = fs.fully_shard_model(
        Net(),
        device_mesh=mesh,
        dp_shard_dim='fsdp',
        tp_dim='tp',
        fsdp_unit_modules=[Block],
        zero_dp_strategy=case.get('strategy', 'optim_grads_params'),
        device=torch.device('cpu'),
        mixed_precision_policy=MixedPrecisionPolicy(
            main_params_dtype=torch.float32,
            main_grads_dtype=bf16[case.get('main_grads_dtype')],
            grad_comm_dtype=bf16[case.get('grad_comm_dtype')],
        ),
        sync_model_each_microbatch=False,
    )
    if not case.get('div_fusion', False):
        model.ddp_config.gradient_reduce_div_fusion = False
    pgb = model.param_and_grad_buffer
    scale = case.get('grad_scale', 1.0)
    groups = []
    for g in pgb.parameter_groups:
        gbuf = g.main_grad_buffer
        if gbuf is None:
            continue
        if 'grad_scale' in case:
            gbuf.gradient_scaling_factor = scale
        groups.append(
            dict(
                dp=gbuf.data_parallel_group.size(),
                distributed=gbuf.is_data_distributed,
                dtype=str(gbuf.dtype),
                scale=gbuf.gradient_scaling_factor,
            )
        )
    for _ in range(cycles):
        model.zero_grad_buffer()
        for k in range(n_micro):
            last = k == n_micro - 1
            with contextlib.nullcontext() if last or case.get('no_no_sync') else model.no_sync():
                model(_data(k, torch.float32)).sum().backward()
        model.finish_grad_sync()
    got = {}
    for g in pgb.parameter_groups:
        gbuf = g.main_grad_buffer
        for p in g.params if gbuf is not None else ():
            item = gbuf.get_item(gbuf.param_idx[p], only_shard=False)
            got[pgb.param_to_name[p].removeprefix('module.')] = (
                item.detach().double().reshape(p.shape)
            )
    ref64 = _eager(n_micro, torch.float64)
    names = sorted(ref64)
    ref, mine = _flat(ref64, names), _flat(got, names) / scale
    eager32 = _flat(_eager(n_micro, torch.float32), names)
    ratios = [float((got[n] / scale * ref64[n]).sum() / (ref64[n] ** 2).sum()) for n in names]
    return dict(
        groups=groups,
        ratio=float((mine * ref).sum() / (ref * ref).sum()),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        rel_err=float((mine - ref).norm() / ref.norm()),
        # The bound's two parts: float32 eager accumulation, and one bf16 rounding of the sum
        # (what a bf16 comm buffer does to the accumulated grads once).
        eager32_rel_err=float((eager32 - ref).norm() / ref.norm()),
        bf16_round_rel_err=float((eager32.bfloat16().double() - ref).norm() / ref.norm()),
    )


def scenario_mfsdp_one_rank_grads(ctx, cases):
    """Run each case (dict: name, n_micro, optional strategy, grad_scale, main_grads_dtype,
    grad_comm_dtype, div_fusion, cycles, no_no_sync); a case's exception is its row's 'error'."""
    from tests.harness import cpu_redirect

    out = []
    with cpu_redirect.megatron_fsdp_mode():
        for case in cases:
            row = {'name': case['name']}
            try:
                row.update(_run(case))
            except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
                row['error'] = f'{type(exc).__name__}: {exc}'[:400]
            out.append(row)
    return {'cases': out}
