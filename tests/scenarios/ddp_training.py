"""DDP + (distributed) optimizer training scenarios against a float64 reference."""

from tests.scenarios.common import init_parallel, train_steps


def scenario_train(ctx, parallel=None, **kwargs):
    """Initialise parallel state (default pure DP) and run common.train_steps(**kwargs)."""
    init_parallel(**(parallel or {}))
    return train_steps(ctx, **kwargs)


def scenario_layout(ctx, **parallel):
    """Initialise parallel_state with ``parallel`` (tp/pp/ep/etp/cp) and report group sizes."""
    from megatron.core import parallel_state as ps

    init_parallel(**parallel)
    return {
        'tp': ps.get_tensor_model_parallel_world_size(),
        'pp': ps.get_pipeline_model_parallel_world_size(),
        'cp': ps.get_context_parallel_world_size(),
        'dp': ps.get_data_parallel_world_size(),
        'dp_cp': ps.get_data_parallel_world_size(with_context_parallel=True),
        'ep': ps.get_expert_model_parallel_world_size(),
        'etp': ps.get_expert_tensor_parallel_world_size(),
        'edp': ps.get_expert_data_parallel_world_size(),
        'tp_rank': ps.get_tensor_model_parallel_rank(),
        'dp_rank': ps.get_data_parallel_rank(),
        'ep_rank': ps.get_expert_model_parallel_rank(),
    }


def scenario_warmup_then_train(
    ctx, warmup_steps=2, num_microbatches=2, steps=1, warmup_no_sync=False, warmup_finalize=True
):
    """Warm-up steps run with the hooks train() has not installed yet, then real steps.

    The warm-up runs with ``config.no_sync_func`` unset (warmup_no_sync=False) and
    finalize_model_grads installed (warmup_finalize=True); the real steps run with both hooks,
    as train() installs them. DDP uses overlap_grad_reduce and the distributed optimizer.
    """
    from tests.scenarios.common import Trainer

    init_parallel()
    trainer = Trainer(ctx, overlap=True, distopt=True, install_hooks=False)
    trainer.install_hooks(no_sync=warmup_no_sync, finalize=warmup_finalize)
    warm = [trainer.step(num_microbatches) for _ in range(warmup_steps)]
    trainer.install_hooks(no_sync=True, finalize=True)
    real = [trainer.step(num_microbatches) for _ in range(steps)]
    return {
        'warmup_losses': [s['loss'] for s in warm],
        'losses': [s['loss'] for s in real],
        'grad_norms': [s['grad_norm'] for s in real],
    }
