"""Candidate 9 (issue 31): ChainedOptimizer's global clip applied to Muon groups (issue 5394).

One process on CPU (gloo, world 1, tests/harness/cpu_redirect.py), upstream's own
get_megatron_optimizer(optimizer='muon') over megatron DDP: a [16, 16] matrix (Muon) and a
[16] vector (Adam, muon_scalar_optimizer). The same grads are written into two copies of the
model, one optimizer with clip_grad=1.0, one with clip_grad=0.0, and each takes one step
(lr 1, no weight decay). The matrix's grad has norm ~16; the vector's grad is BIG * ones, so the
global norm, and the clip coefficient 1 / norm, come from the vector alone.

Printed per BIG: the clip coefficient, the Muon update's norm with and without the clip, their
cosine, and the update's singular values over those of the unclipped one (1 where Newton-Schulz
orthogonalized the clipped input as it does the unclipped one).

Usage: PYTHONPATH=<emerging-optimizers install>:<megatron tree> python muon_clip_repro.py
(from the repository root; emerging-optimizers 0.3.0 from PyPI, installed with --target).
"""

import os
import sys

import torch

sys.path.append(os.getcwd())  # tests/ only: megatron comes from PYTHONPATH
from tests.harness import cpu_redirect  # noqa: E402

cpu_redirect.install()

SIZE = 16


def _step(clip, w_grad, b_grad, w0):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.scenarios.common import ParamBag, make_config

    config = make_config('fp32', hidden_size=SIZE)
    module = ParamBag({'weight': w0.clone(), 'bias': torch.zeros(SIZE)})
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer='muon', lr=1.0, min_lr=1.0, weight_decay=0.0, clip_grad=clip),
        [model],
        use_gloo_process_groups=False,
    )
    module.weight.main_grad.copy_(w_grad)
    module.bias.main_grad.copy_(b_grad)
    ok, norm, _ = opt.step()
    kinds = sorted({type(o.optimizer).__name__ for o in getattr(opt, 'chained_optimizers', [opt])})
    return (module.weight.detach() - w0), float(norm), ok, kinds


def main():
    import megatron.core
    from megatron.core import parallel_state

    torch.distributed.init_process_group(
        'gloo', init_method='tcp://127.0.0.1:29533', rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(SIZE, SIZE, generator=g)
    w_grad = torch.randn(SIZE, SIZE, generator=g)
    print(
        f'megatron-core {megatron.core.__version__} from {megatron.core.__file__}, torch {torch.__version__}'
    )
    print(f'matrix grad norm {float(w_grad.norm()):.4g}')
    for big in (1e2, 1e6, 1e9, 1e10, 1e12):
        b_grad = torch.full((SIZE,), big)
        clipped, norm, ok, kinds = _step(1.0, w_grad, b_grad, w0)
        free, _, _, _ = _step(0.0, w_grad, b_grad, w0)
        cos = float((clipped * free).sum() / (clipped.norm() * free.norm()).clamp(min=1e-30))
        sv = torch.linalg.svdvals(clipped) / torch.linalg.svdvals(free)
        print(
            f'vector grad {big:.0e}: grad norm {norm:.4g}, clip coeff {1.0 / norm:.3g}, '
            f'matrix input to NS {float(w_grad.norm()) / norm * 0.0975:.3g}; '
            f'update norm clipped {float(clipped.norm()):.4g} / unclipped {float(free.norm()):.4g}'
            f' = {float(clipped.norm() / free.norm()):.4g}, cosine {cos:.4f}, '
            f'singular-value ratio min {float(sv.min()):.3g} max {float(sv.max()):.3g} '
            f'({kinds}, stepped {ok})'
        )


if __name__ == '__main__':
    main()
