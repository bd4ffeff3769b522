"""What train() installs before its loop, pinned against PRISTINE upstream train() (patch 0003,
`training-train-loop-hooks`, and its use by the warmup, `training-warmup-train-steps`).

0003 moves train()'s loop set-up into install_train_loop_hooks(), which train() and the warmup
both call. A test that compares the warmup with the fork's own train() cannot see a break of that
function: both arms share it. Here the reference is upstream's own train() on the pristine base:
a GPT entry point (the project's driver; upstream's pretrain_gpt.py too in the megatron-lm tier)
runs through the real pretrain() on both trees, and at every train_step
call and at the end of train() the model config's callbacks are recorded as "which bound method of
which object" (or the function's name, or None), with the DDP forward pre-hook state. The fork,
with and without --warmup-train-steps 2, must record exactly what pristine records at the same
real step; each warmup step must record what pristine records at the same step of its loop.

Layouts (world 2), each covering what a mutation of the moved set-up would change:
- 'vpp': PP 2 x VPP 2, fp16 (grad_scale_func is the loss scaler), distributed optimizer,
  overlap_grad_reduce with align_grad_reduce, overlap_param_gather with align_param_gather
  (param_sync_func: None at the first step, put back for the second), and a finalize hook that the
  model's builder installed before train();
- 'dp-no-align': DP 2, overlap_grad_reduce with --no-align-grad-reduce (no grad_sync_func);
- 'dp-no-overlap': DP 2, no overlap_grad_reduce (no no_sync_func nor grad_sync_func).
"""

import pytest

from tests.harness import bases, call
from tests.scenarios.pretrain import driver_params, drivers_here, tiny_gpt_args
from tests.scenarios.warmup_observed import results_of

S = 'tests.scenarios.warmup_observed:scenario_observe'
REF = bases.upstream_ref()
ITERS = 3
WARMUP = ['--warmup-train-steps', '2']
VPP = ['--pipeline-model-parallel-size', '2', '--num-layers', '4']
VPP += ['--num-layers-per-virtual-pipeline-stage', '1', '--overlap-param-gather']

LAYOUTS = {
    'vpp': (tiny_gpt_args(2, ITERS, dtype='fp16') + VPP, {'finalize_hook': True}),
    'dp-no-align': (tiny_gpt_args(2, ITERS, distopt=False) + ['--no-align-grad-reduce'], {}),
    'dp-no-overlap': (tiny_gpt_args(2, ITERS, dtype='fp32', overlap=False), {}),
}
# (layout, arm): the fork without the flag runs where it adds a case (PP x VPP).
ARMS = [('vpp', 'none'), ('vpp', 'warmup'), ('dp-no-align', 'warmup'), ('dp-no-overlap', 'warmup')]
PRISTINE_RUNS = {
    (driver, layout): call(
        2, bases.PRISTINE, S, argv=argv, driver=driver, tag=REF, timeout=240, **opts
    )
    for driver in drivers_here()
    for layout, (argv, opts) in LAYOUTS.items()
}
FORK_RUNS = {
    (driver, layout, arm): call(
        2,
        bases.FORK,
        S,
        argv=LAYOUTS[layout][0] + (WARMUP if arm == 'warmup' else []),
        driver=driver,
        tag=REF,
        timeout=240,
        **LAYOUTS[layout][1],
    )
    for driver in drivers_here()
    for layout, arm in ARMS
}
DRIVERS = driver_params()


_ok = results_of


def _steps(res, kind):
    return [step['installed'] for step in res['steps'] if step['kind'] == kind]


@pytest.mark.parametrize('driver', DRIVERS)
@pytest.mark.parametrize('layout,arm', ARMS)
def test_train_installs_what_pristine_train_installs(layout, arm, driver):
    pristine = _ok(PRISTINE_RUNS[(driver, layout)])
    fork = _ok(FORK_RUNS[(driver, layout, arm)])
    for rank, (p, f) in enumerate(zip(pristine, fork)):
        assert _steps(p, 'warmup') == []
        assert len(_steps(p, 'real')) == ITERS, f'rank {rank}'
        assert _steps(f, 'real') == _steps(p, 'real'), f'rank {rank}: real steps'
        assert f['end'] == p['end'], f'rank {rank}: after train()'
        warmup = _steps(f, 'warmup')
        assert len(warmup) == (2 if arm == 'warmup' else 0), f'rank {rank}'
        # Warmup step k runs with what train() installs for its own step k.
        assert warmup == _steps(p, 'real')[: len(warmup)], f'rank {rank}: warmup steps'


@pytest.mark.parametrize('driver', DRIVERS)
@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_fork_without_the_flag_trains_as_pristine(layout, driver):
    """The same losses at every real step (the record above is of a run that trained)."""
    arm = 'none' if (layout, 'none') in ARMS else 'warmup'
    pristine = _ok(PRISTINE_RUNS[(driver, layout)])
    fork = _ok(FORK_RUNS[(driver, layout, arm)])
    for rank, (p, f) in enumerate(zip(pristine, fork)):
        losses = [step['loss'] for step in p['steps'] if step['kind'] == 'real']
        assert [step['loss'] for step in f['steps'] if step['kind'] == 'real'] == losses, rank


@pytest.mark.parametrize('driver', DRIVERS)
def test_the_layouts_cover_each_callback(driver):
    """What pristine train() installs differs between the layouts where a break would show."""
    vpp = _ok(PRISTINE_RUNS[(driver, 'vpp')])[0]['steps']
    no_align = _ok(PRISTINE_RUNS[(driver, 'dp-no-align')])[0]['steps']
    no_overlap = _ok(PRISTINE_RUNS[(driver, 'dp-no-overlap')])[0]['steps']
    first, second = vpp[0]['installed'], vpp[1]['installed']
    assert first['grad_scale_func'] == 'optimizer.scale_loss'
    # align_param_gather: held back for the first step, put back with the pre-hooks.
    assert first['param_sync_func'] is None and first['forward_pre_hooks'] == [False, False]
    assert second['param_sync_func'] == ['model[0].start_param_sync', 'model[1].start_param_sync']
    assert second['forward_pre_hooks'] == [True, True]
    assert first['grad_sync_func'] == ['model[0].start_grad_sync', 'model[1].start_grad_sync']
    if bases.BASE != '0.18.2':  # 0.18.2's train() overwrites a builder's finalize hook
        assert first['finalize_model_grads_func'].endswith('.builder_finalize_model_grads')
    assert no_align[0]['installed']['no_sync_func'] == 'model[0].no_sync'
    assert no_align[0]['installed']['grad_sync_func'] is None
    assert no_overlap[0]['installed']['no_sync_func'] is None
    assert no_overlap[0]['installed']['finalize_model_grads_func'].endswith(
        'finalize_model_grads.finalize_model_grads'
    )
