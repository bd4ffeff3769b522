"""Tests of the harness itself: redirect, tree checks, error reporting, an upstream-bug proof."""

import os
import re

import pytest

from tests.harness import TreeShadowedError, call, launcher, run_world, tiers

SELF = 'tests.harness.selftest_scenarios'
PRISTINE = 'pristine-0.18.2'
CPU_ONLY = tiers.skipif(
    launcher.backend() != 'gloo', 'nccl', 'checks the CPU redirect (FORK_TEST_BACKEND=gloo only)'
)

INFO = call(2, PRISTINE, f'{SELF}:scenario_info')
RAISE = call(2, PRISTINE, f'{SELF}:scenario_raise', message='boom')
UNCOVERED = call(2, PRISTINE, f'{SELF}:scenario_uncovered_cuda')
REDIRECTED = call(2, PRISTINE, f'{SELF}:scenario_redirected')
INFO_AFTER = call(2, PRISTINE, f'{SELF}:scenario_info')
WARMUP = 'tests.scenarios.ddp_training:scenario_warmup_then_train'
WARMUP_ACCUM2 = call(2, PRISTINE, WARMUP, warmup_steps=2, num_microbatches=2, steps=1)
WARMUP_ACCUM1 = call(2, PRISTINE, WARMUP, warmup_steps=2, num_microbatches=1, steps=2)


def test_world_runs_requested_tree():
    per_rank = INFO.result()
    tree = os.path.realpath(os.path.join(launcher.REPO, 'build', 'trees', PRISTINE))
    for rank, r in enumerate(per_rank):
        assert r['rank'] == rank and r['world_size'] == 2 and r['tree'] == PRISTINE
        assert os.path.realpath(r['core_file']).startswith(tree + os.sep)
        assert r['sum'] == 3.0


def test_scenario_exception_reported_per_rank_with_exact_text():
    assert RAISE.result() == [
        {'error': 'ValueError: boom on rank 0'},
        {'error': 'ValueError: boom on rank 1'},
    ]
    # the world survives an exception: a later call in the same world still runs
    assert INFO_AFTER.result()[1]['sum'] == 3.0


def test_dead_rank_leaves_its_log_tail_for_the_summary():
    # A CI report shows pytest's output only: the log of a rank that died must reach it. A rank
    # that aborts every time is reported as dead after the one fresh world it gets.
    before = len(launcher.DEATHS)
    calls = [(f'{SELF}:scenario_info', {}), (f'{SELF}:scenario_abort', {'rank': 1})]
    per_rank = run_world(2, PRISTINE, calls, timeout=300)
    assert per_rank[0][1]['sum'] == 3.0
    assert per_rank[1][0] == {'rank': 0}
    assert per_rank[1][1]['error'].startswith('HarnessError: rank 1 exited (rc -6) before call 0 ')
    deaths = launcher.DEATHS[before:]
    del launcher.DEATHS[before:]
    assert len(deaths) == 3, deaths
    assert deaths[0].startswith(
        f'{PRISTINE} world 2: HarnessError: rank 1 exited (rc -6) before call 1'
    )
    assert (
        deaths[1]
        == f'{PRISTINE} world 2: calls 1-1 run again in a fresh world after the death above'
    )
    assert deaths[2].startswith(
        f'{PRISTINE} world 2: HarnessError: rank 1 exited (rc -6) before call 0'
    )
    for text in (deaths[0], deaths[2]):
        assert 'selftest: rank 1 aborts now' in text
        # faulthandler in the worker: the Python stack of the abort is in the tail
        assert 'Fatal Python error: Aborted' in text and 'in scenario_abort' in text


def test_rank_killed_by_a_signal_once_runs_its_calls_again(tmp_path):
    # An abort outside Python (a collective's thread, the allocator) is no result of the code
    # under test: the calls it left unfinished get one fresh world; earlier results are kept.
    before = len(launcher.DEATHS)
    marker = str(tmp_path / 'aborted')
    calls = [
        (f'{SELF}:scenario_raise', {'message': 'kept'}),
        (f'{SELF}:scenario_abort', {'rank': 0, 'marker': marker}),
        (f'{SELF}:scenario_info', {}),
    ]
    per_rank = run_world(2, PRISTINE, calls, timeout=300)
    deaths = launcher.DEATHS[before:]
    del launcher.DEATHS[before:]
    assert per_rank[0] == [
        {'error': 'ValueError: kept on rank 0'},
        {'error': 'ValueError: kept on rank 1'},
    ]
    assert per_rank[1] == [{'rank': 0}, {'rank': 1}]
    assert [r['sum'] for r in per_rank[2]] == [3.0, 3.0]
    assert len(deaths) == 2 and 'rank 0 exited (rc -6) before call 1' in deaths[0], deaths
    assert (
        deaths[1]
        == f'{PRISTINE} world 2: calls 1-2 run again in a fresh world after the death above'
    )


def test_rank_that_exits_by_itself_is_not_run_again():
    # Only a signal of its own gets a rank a fresh world: an exit status is the code's answer.
    before = len(launcher.DEATHS)
    calls = [(f'{SELF}:scenario_exit', {'rank': 1, 'code': 5}), (f'{SELF}:scenario_info', {})]
    per_rank = run_world(2, PRISTINE, calls, timeout=300)
    deaths = launcher.DEATHS[before:]
    del launcher.DEATHS[before:]
    assert per_rank[0][1]['error'].startswith('HarnessError: rank 1 exited (rc 5) before call 0 ')
    assert per_rank[1][1]['error'].startswith('HarnessError: rank 1 exited (rc 5) before call 1 ')
    assert len(deaths) == 1 and 'rank 1 exited (rc 5) before call 0' in deaths[0], deaths


@CPU_ONLY
def test_redirect_fails_loudly_on_uncovered_cuda_call():
    for err in UNCOVERED.errors():
        assert err.startswith(
            'UncoveredCudaCall: torch.cuda.get_device_properties is not covered by the CPU '
            'redirect (tests/harness/cpu_redirect.py)'
        ), err


@CPU_ONLY
def test_redirected_calls_land_on_cpu():
    for r in REDIRECTED.result():
        assert r == {
            'zeros_device': 'cpu',
            'ones_device': 'cpu',
            'type_fp32': 'torch.cuda.FloatTensor',
            'type_bf16': 'torch.cuda.BFloat16Tensor',
            'cuda_call_device': 'cpu',
            'to_device': 'cpu',
        }


def test_launcher_refuses_shadowed_tree(tmp_path):
    (tmp_path / 'megatron').mkdir()  # a tree whose megatron.core comes from somewhere else
    env = {'PYTHONPATH': os.path.realpath(os.path.join(launcher.REPO, 'build', 'trees', PRISTINE))}
    with pytest.raises(TreeShadowedError, match='is not under the tree under test'):
        run_world(1, str(tmp_path), [(f'{SELF}:scenario_info', {})], timeout=300, extra_env=env)


def test_unknown_tree_label_is_refused():
    with pytest.raises(launcher.HarnessError, match='unknown tree'):
        launcher.resolve_tree('not-a-tree')


def test_counterfactual_warmup_without_no_sync_hits_upstream_assertion():
    """Upstream 0.18.2 bug reproduced on CPU ranks: a warm-up with accumulation 2 and no
    no_sync_func calibrates the DDP buckets with 2 grad-ready counts per param; the first real
    step with no_sync then never issues the bucket's reduction and finish_grad_sync asserts."""
    pattern = re.compile(
        r'AssertionError: Communication call has not been issued for this bucket '
        r'\((\d+)/(\d+) params have grad available\)'
    )
    for err in WARMUP_ACCUM2.errors():
        m = pattern.fullmatch(err or '')
        assert m, err
        assert m.group(1) == m.group(2)


def test_counterfactual_control_accumulation_1_trains():
    for r in WARMUP_ACCUM1.result():
        assert 'error' not in r, r
        assert len(r['losses']) == 2 and all(x == x for x in r['losses'])
