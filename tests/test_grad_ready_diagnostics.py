"""DDP with overlap_grad_reduce: a param that never reports its grad is named (patch 0007).

Counterfactual arms, same scenario on both trees (real DDP, no-pipelining schedule,
finalize_model_grads, get_megatron_optimizer; fp32 + distributed optimizer and bf16 without):
- pristine 0.18.2 / 0.19.2: a param unused from the start fails at the next zero_grad_buffer() with
  a bare ``AssertionError`` (empty message); one that stops reporting later fails with
  "Communication call has not been issued for this bucket (k/n params have grad available)".
- fork: the same exception type at the same place, the same leading text where there was one, plus
  the names and shapes of exactly the params that did not report (or reported fewer times than
  calibrated), the rank, and the likely cause. Correct runs are bit-identical to pristine.
"""

import pytest

from tests.harness import call

MOD = 'tests.scenarios.grad_ready_diagnostics:scenario_missing_grad'
FORK = 'fork'
PRISTINE = 'pristine-0.18.2'
PRISTINE_0_19 = 'pristine-0.19.2'
WS = [1, 2]
VARIANTS = [('fp32', True), ('bf16', False)]
MODES = ['unused', 'skip_later', 'freeze_later', 'expert_unused', 'undercount', 'none']


def _register(tree, world):
    calls = {}
    for mode in MODES:
        for dtype, distopt in VARIANTS:
            calls[(mode, dtype, distopt)] = call(
                world, tree, MOD, mode=mode, dtype=dtype, distopt=distopt
            )
    # One bucket group per param: only the group of the silent param fails, and only it is named.
    calls[('skip_later', 'fp32', 'buckets')] = call(
        world, tree, MOD, mode='skip_later', dtype='fp32', distopt=True, bucket_size=1
    )
    return calls


CALLS = {(tree, ws): _register(tree, ws) for tree in (FORK, PRISTINE) for ws in WS}
CALLS[(PRISTINE_0_19, 2)] = _register(PRISTINE_0_19, 2)

NO_COMM = 'AssertionError: Communication call has not been issued for this bucket'
# mode -> (phase, step, pristine message, params that must be named as missing)
EXPECTED = {
    'unused': ('zero_grad_buffer', 1, 'AssertionError: ', ['net.branch.bias', 'net.branch.weight']),
    'expert_unused': ('zero_grad_buffer', 1, 'AssertionError: ', ['net.branch.bias']),
    'skip_later': (
        'forward_backward',
        1,
        f'{NO_COMM} (4/6 params have grad available)',
        ['net.branch.bias', 'net.branch.weight'],
    ),
    'freeze_later': (
        'forward_backward',
        1,
        f'{NO_COMM} (5/6 params have grad available)',
        ['net.branch.weight'],
    ),
    'undercount': ('forward_backward', 1, f'{NO_COMM} (6/6 params have grad available)', []),
}
SHAPES = {'net.branch.bias': (16,), 'net.branch.weight': (16, 16)}
ALL = ['net.fc1.weight', 'net.fc1.bias', 'net.branch.weight', 'net.branch.bias']
ALL += ['net.head.weight', 'net.head.bias']


def _prefix(dtype):
    # bf16 models are wrapped in Float16Module, so DDP sees the names under 'module.'.
    return 'module.' if dtype == 'bf16' else ''


def _missing_section(message):
    start = message.index('did not register a grad')
    end = message.index('Likely cause', start)
    return message[start:end]


@pytest.mark.parametrize('tree,ws', [(PRISTINE, 1), (PRISTINE, 2), (PRISTINE_0_19, 2)])
@pytest.mark.parametrize('mode', sorted(EXPECTED))
def test_pristine_error_is_opaque(tree, ws, mode):
    phase, step, message, _ = EXPECTED[mode]
    for variant in VARIANTS:
        for res in CALLS[(tree, ws)][(mode, *variant)].result():
            assert (res['error'], res['phase'], res['step']) == (message, phase, step), res
            assert len(res['grad_norms']) == 1


@pytest.mark.parametrize('ws', WS)
@pytest.mark.parametrize('mode', sorted(EXPECTED))
def test_fork_names_what_did_not_report(ws, mode):
    phase, step, pristine_message, missing = EXPECTED[mode]
    for dtype, distopt in VARIANTS:
        per_rank = CALLS[(FORK, ws)][(mode, dtype, distopt)].result()
        prefix = _prefix(dtype)
        for rank, res in enumerate(per_rank):
            error = res['error']
            assert (res['phase'], res['step']) == (phase, step), res
            assert error.startswith('AssertionError: '), error
            # The finish_grad_sync message keeps upstream's text as its first sentence.
            assert error.startswith(pristine_message), error
            assert f'On rank {rank},' in error
            if phase == 'zero_grad_buffer':
                assert error.startswith('AssertionError: Grad-ready calibration failed: in the')
            if missing:
                assert f'{len(missing)} param(s) did not register a grad' in error
                section = _missing_section(error)
                for name in ALL:
                    listed = f'{prefix}{name} ' in section
                    assert listed == (name in missing), (name, section)
                for name in missing:
                    assert f'{prefix}{name} {SHAPES[name]}' in section
                assert 'not used in forward' in error
                assert 'requires_grad=False' in error and 'before wrapping' in error
                assert 'registered fewer times' not in error
            else:
                assert 'did not register' not in error
                assert '6 param(s) registered fewer times than in the calibration batch' in error
                for name in ALL:
                    assert f'{prefix}{name} ' in error and '(1 of 2)' in error
                assert 'no_sync_func' in error and 'reset_grad_ready_calibration()' in error


@pytest.mark.parametrize('ws', WS)
def test_fork_names_only_the_failing_bucket_group(ws):
    fork = CALLS[(FORK, ws)][('skip_later', 'fp32', 'buckets')].result()
    pristine = CALLS[(PRISTINE, ws)][('skip_later', 'fp32', 'buckets')].result()
    for f, p in zip(fork, pristine):
        assert len(f['groups']) == 6  # one bucket group per param
        assert p['error'] == f'{NO_COMM} (0/1 params have grad available)'
        assert f['error'].startswith(p['error'])
        section = _missing_section(f['error'])
        named = [n for n in ALL if f'{n} ' in section]
        assert len(named) == 1 and named[0] in ('net.branch.bias', 'net.branch.weight'), section


@pytest.mark.parametrize('ws', WS)
def test_correct_runs_unchanged(ws):
    for variant in VARIANTS:
        fork = CALLS[(FORK, ws)][('none', *variant)].result()
        pristine = CALLS[(PRISTINE, ws)][('none', *variant)].result()
        for f, p in zip(fork, pristine):
            assert f['error'] is None and p['error'] is None
            assert len(f['grad_norms']) == 3
            assert f['grad_norms'] == p['grad_norms']


# One bucket group of two buckets (DDP disable_bucketing=True, fp32 and bf16 params: two buffers),
# the silent params in the second bucket, and more of them than the message lists (8).
WIDE = 'tests.scenarios.grad_ready_diagnostics:scenario_wide_group'
WIDE_MODES = ['skip_later', 'undercount', 'none']
WIDE_CALLS = {
    (tree, mode): call(2, tree, WIDE, mode=mode)
    for tree in (FORK, PRISTINE, PRISTINE_0_19)
    for mode in WIDE_MODES
}
# mode -> (pristine message, section of the fork's message, the params it names)
WIDE_EXPECTED = {
    'skip_later': (
        f'{NO_COMM} (4/16 params have grad available)',
        '12 param(s) did not register a grad in this batch: ',
        lambda name: name.startswith('net.branch.'),
    ),
    'undercount': (
        f'{NO_COMM} (16/16 params have grad available)',
        '16 param(s) registered fewer times than in the calibration batch (this batch of '
        'calibrated): ',
        lambda name: True,
    ),
}


def _listing(res, selected, counts):
    """The listing the fork's message must hold: the first 8 selected params in bucket order."""
    order = [name for bucket in res['buckets'][0] for name in bucket]
    named = [name for name in order if selected(name)]
    items = [f'{name} {tuple(res["shapes"][name])}{counts}' for name in named[:8]]
    if len(named) > 8:
        items.append(f'... and {len(named) - 8} more')
    return ', '.join(items)


@pytest.mark.parametrize('tree', [PRISTINE, PRISTINE_0_19])
def test_pristine_wide_group_error_is_opaque(tree):
    for mode, (message, _, _) in WIDE_EXPECTED.items():
        for res in WIDE_CALLS[(tree, mode)].result():
            assert (res['error'], res['phase'], res['step']) == (message, 'forward_backward', 1)


@pytest.mark.parametrize('mode', sorted(WIDE_EXPECTED))
def test_fork_wide_group_names_the_second_bucket_first_eight(mode):
    message, section, selected = WIDE_EXPECTED[mode]
    counts = ' (1 of 2)' if mode == 'undercount' else ''
    for rank, res in enumerate(WIDE_CALLS[(FORK, mode)].result()):
        # The configuration: one bucket group of two buckets, the branch all in the second.
        [[first, second]] = res['buckets']
        assert {n.split('.')[1] for n in first} == {'fc1', 'head'}, first
        assert len(second) == 12 and all(n.startswith('net.branch.') for n in second), second
        assert (res['phase'], res['step']) == ('forward_backward', 1), res
        error = res['error']
        assert error.startswith(f'{message}. '), error
        listing = _listing(res, selected, counts)
        assert listing.endswith(', ... and 4 more' if mode == 'skip_later' else ', ... and 8 more')
        assert f'On rank {rank}, {section}{listing}. Likely cause' in error, (listing, error)
        assert error.count('param(s)') == 1, error


def test_wide_group_correct_run_unchanged():
    fork = WIDE_CALLS[(FORK, 'none')].result()
    for tree in (PRISTINE, PRISTINE_0_19):
        for f, p in zip(fork, WIDE_CALLS[(tree, 'none')].result()):
            assert f['error'] is None and p['error'] is None
            assert len(f['grad_norms']) == 2
            assert f['grad_norms'] == p['grad_norms']
