"""Issue 39 item 4: GatedDeltaNet's ``out_norm`` weight grads under TP without sequence
parallelism (Megatron-LM issue 7452, finding 11).

``out_norm`` is a replicated RMSNorm over the value-head dimension, applied to this TP rank's
value heads only (``in_proj`` is column-parallel by heads), so each rank's weight grad is a
partial sum; ``finalize_model_grads`` sums such grads over TP only under sequence parallelism.

What runs is the tree's own: ``GatedDeltaNet`` (constructor, Column/RowParallelLinear, conv1d,
gates, the gated norm), megatron DDP, ``finalize_model_grads`` and ``get_megatron_optimizer``
(grad norm, Adam steps). Stood in, as CPU has no FLA, Triton or TE: the FLA import guard and
fla's ``l2norm`` (its formula); ``config.deterministic_mode=True`` selects upstream's own torch
paths (F.conv1d and the torch chunked delta rule); ``out_norm`` is torch's RMSNorm
(``WrappedTorchNorm``) with its params marked ``sequence_parallel`` as TE's RMSNorm marks them;
dynamo is off. The reference is the same layer at TP 1 in a world of one rank, with the same
logical parameters.
"""

import contextlib

import torch

HIDDEN = 16
NK, NV, DK, DV = 2, 4, 4, 4  # key heads, value heads, key head dim, value head dim
KCONV = 4
SEQ, BATCH = 8, 2
SEED = 7452
STEPS, LR = 5, 1e-2


def _logical():
    g = torch.Generator().manual_seed(SEED)
    qk, v = NK * DK, NV * DV
    r = lambda *s, scale=0.3: (torch.randn(*s, generator=g, dtype=torch.float64) * scale)
    return {
        # in_proj rows: [q (qk), k (qk), v (v), z (v), beta (NV), alpha (NV)]
        'in_proj': [
            r(qk, HIDDEN),
            r(qk, HIDDEN),
            r(v, HIDDEN),
            r(v, HIDDEN),
            r(NV, HIDDEN),
            r(NV, HIDDEN),
        ],
        # conv1d channels: [q, k, v]
        'conv1d': [r(qk, 1, KCONV), r(qk, 1, KCONV), r(v, 1, KCONV)],
        'dt_bias': r(NV, scale=1.0),
        'A_log': torch.log(torch.linspace(1.0, 4.0, NV, dtype=torch.float64)),
        'out_norm': 1.0 + r(DV),
        'out_proj': r(HIDDEN, v),
        'x': r(SEQ, BATCH, HIDDEN, scale=1.0),
        'w': r(SEQ, BATCH, HIDDEN, scale=1.0),
    }


def _shard(sections, t, tp, dim=0):
    return torch.cat([s.chunk(tp, dim=dim)[t] for s in sections], dim=dim)


@contextlib.contextmanager
def _stand_ins(gdn_mod_names):
    """The MoE oracle's CPU stand-ins (tracker fork, eager, the norm marked as TE marks it) and
    FLA's guard and ``l2norm`` (its formula) in the GatedDeltaNet modules."""
    import importlib

    from tests.scenarios.moe_oracle import _cpu_stand_ins

    saved = []
    for name in gdn_mod_names:
        mod = importlib.import_module(name)
        for attr, val in (
            ('HAVE_FLA', True),
            (
                'l2norm',
                lambda x, dim=-1, eps=1e-6: x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps),
            ),
        ):
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, val)
    try:
        with _cpu_stand_ins():
            yield
    finally:
        for mod, attr, val in saved:
            setattr(mod, attr, val)


def _run(case):
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, sp = case['tp'], case.get('sp', False)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            params_dtype=torch.float64,
            pipeline_dtype=torch.float64,
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
            add_bias_linear=False,
            use_cpu_initialization=True,
            perform_initialization=False,
            normalization='RMSNorm',
            activation_func=F.silu,
            deterministic_mode=True,
            linear_conv_kernel_dim=KCONV,
            linear_key_head_dim=DK,
            linear_value_head_dim=DV,
            linear_num_key_heads=NK,
            linear_num_value_heads=NV,
        )

        class Wrap(MegatronModule):
            def __init__(self):
                super().__init__(config=config)
                self.gdn = GatedDeltaNet(
                    config,
                    GatedDeltaNetSubmodules(
                        in_proj=ColumnParallelLinear,
                        out_norm=WrappedTorchNorm,
                        out_proj=RowParallelLinear,
                    ),
                    layer_number=1,
                    pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                )

            def forward(self, x):
                out, _ = self.gdn(x, None)
                return out

        module = Wrap()
        gdn = module.gdn
        t = ps.get_tensor_model_parallel_rank()
        L = _logical()
        with torch.no_grad():
            gdn.in_proj.weight.copy_(_shard(L['in_proj'], t, tp))
            gdn.conv1d.weight.copy_(_shard(L['conv1d'], t, tp))
            gdn.dt_bias.copy_(L['dt_bias'].chunk(tp)[t])
            gdn.A_log.copy_(L['A_log'].chunk(tp)[t])
            gdn.out_norm.weight.copy_(L['out_norm'])
            gdn.out_proj.weight.copy_(L['out_proj'].chunk(tp, dim=1)[t])
        attrs = {
            k: getattr(gdn.out_norm.weight, k, None)
            for k in (
                'sequence_parallel',
                'tensor_model_parallel',
                'average_gradients_across_tp_domain',
            )
        }
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), module
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer='adam', lr=LR, clip_grad=0.0, weight_decay=0.0, params_dtype=torch.float64
            ),
            [model],
            use_gloo_process_groups=False,
        )
        x, w = L['x'], L['w']
        if sp:  # SP: the layer's input and output are sequence shards
            x, w = x.chunk(tp)[t], w.chunk(tp)[t]
        res = {'attrs': attrs, 'out_norm_in_rows_per_rank': None}
        seen = {}

        def _hook(m, i, o):  # must return None (a value would replace the output)
            seen.setdefault('rows', list(i[0].shape))

        hook = gdn.out_norm.register_forward_hook(_hook)
        for step in range(STEPS):
            model.zero_grad_buffer()
            opt.zero_grad()
            out = model(x.clone())
            (out * w).sum().backward()
            finalize_model_grads([model])
            if step == 0:
                res['out_norm_grad'] = gdn.out_norm.weight.main_grad.double().tolist()
                res['in_proj_grad_norm_local'] = float(gdn.in_proj.weight.main_grad.norm())
                res['output'] = out.detach().double().flatten().tolist()[:6]
            ok, gnorm, _ = opt.step()
            if step == 0:
                res['grad_norm'] = float(gnorm)
        hook.remove()
        res['out_norm_input_shape'] = seen.get('rows')
        res['out_norm_weight_after'] = gdn.out_norm.weight.detach().double().tolist()
        return res
    finally:
        ps.destroy_model_parallel()


def scenario_gdn_out_norm(ctx, cases):
    names = ['megatron.core.ssm.gated_delta_net']
    import importlib

    try:
        importlib.import_module('megatron.core.ssm.gated_delta_net.common')
        names.append('megatron.core.ssm.gated_delta_net.common')
        names.append('megatron.core.ssm.gated_delta_net.gdn')
    except ImportError:
        pass
    from tests.scenarios.common import each_case

    with _stand_ins(names):
        return {'cases': each_case(cases, _run)}
