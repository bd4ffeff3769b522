"""tools/maint/first_five_table.py on synthetic pretrain_gpt.py logs: fp16's skipped iterations
(upstream prints neither lm loss nor grad norm for them) are left out, the ratios are against the
median of the 10th-30th stepped iterations, and a warmup arm whose losses differ from the none
runs' is flagged."""

import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[2] / 'tools' / 'maint' / 'first_five_table.py'


def _log(path, times, skipped=(), losses=None, norms=None):
    lines = []
    for it, ms in enumerate(times, 1):
        loss = (losses or {}).get(it, f'{10 - it * 0.01:.6E}')
        norm = (norms or {}).get(it, '1.000')
        # upstream's training_log: a skipped iteration has no lm loss and no grad norm
        stats = (
            ' loss scale: 2.0 | number of skipped iterations: 1 |'
            if it in skipped
            else f' lm loss: {loss} | loss scale: 1.0 | grad norm: {norm} |'
            ' number of skipped iterations: 0 |'
        )
        lines.append(
            f' [2026-12-04] iteration {it:8d}/      30 | consumed samples: {4 * it} | elapsed time '
            f'per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 |{stats}'
        )
    path.write_text('\n'.join(lines) + '\n')


def _table(*dirs):
    cmd = [sys.executable, str(TOOL), *map(str, dirs)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    return run.returncode, run.stdout, run.stderr


def _rows(out):
    return {tuple(c.strip() for c in line.split('|')[1:3]): line for line in out.splitlines()}


def test_ratios_skip_fp16_overflow_steps_and_flag_changed_losses(tmp_path):
    steady = [100.0] * 32
    _log(tmp_path / 'm-none-1.log', [300.0, 150.0, 120.0, 110.0, 101.0] + steady[5:30])
    # fp16: iterations 1 and 2 skipped by the scaler: the first stepped one is 3, and the steady
    # window is the 10th-30th stepped iterations (12-32), not iterations 10-30.
    times = [500.0, 400.0, 104.0] + [100.0] * 6 + [200.0] * 11 + [100.0] * 12
    _log(tmp_path / 'h-warmup2-1.log', times, skipped=(1, 2))
    _log(tmp_path / 'h-none-1.log', steady, skipped=(1, 2))
    _log(tmp_path / 'm-warmup5-1.log', steady[:30], losses={7: '1.000000E+00'})
    rc, out, err = _table(tmp_path)
    assert rc == 0, err
    rows = _rows(out)
    assert (
        '| 3.00 (3.00) | 1.50 (1.50) | 1.20 (1.20) | 1.10 (1.10) | 1.01 (1.01) | 1/5 | yes |'
        in (rows[('m', 'none')])
    )
    assert '| 1.04 (1.04) | 1.00 (1.00) |' in rows[('h', 'warmup2')]
    assert rows[('h', 'warmup2')].endswith('| 5/5 | yes |')
    assert rows[('m', 'warmup5')].endswith('| 5/5 | NO |')
    assert rows[('m', 'control (none, it 6-10)')].endswith('| 5/5 | - |')
    assert '*' not in out


def test_losses_compared_with_the_none_runs_of_other_repeats(tmp_path):
    # a warmup arm run in a batch without its own none run is still checked against the none runs
    _log(tmp_path / 'm-none-a1.log', [100.0] * 30)
    _log(tmp_path / 'm-none-a2.log', [100.0] * 30)
    _log(tmp_path / 'm-warmup10-c1.log', [100.0] * 30)
    _log(tmp_path / 'm-warmup10-c2.log', [100.0] * 30, losses={30: '2.000000E+00'})
    _log(tmp_path / 'm-warmup5-c1.log', [100.0] * 30, norms={3: '1.001'})
    _log(tmp_path / 'n-warmup2-c1.log', [100.0] * 30)
    rc, out, _ = _table(tmp_path)
    assert rc == 0
    rows = _rows(out)
    assert rows[('m', 'none')].endswith('| yes |')
    assert rows[('m', 'warmup10')].endswith('| NO |')
    assert rows[('m', 'warmup5')].endswith('| NO |')  # same losses, another grad norm
    assert rows[('n', 'warmup2')].endswith('| NO |')  # no none run: nothing shows it unchanged


def test_short_fp16_run_falls_back_and_says_so(tmp_path):
    # 30 iterations, 16 skipped: 14 stepped, fewer than 8 of them 10th-30th (the H200 fp16 runs)
    times = [50.0] * 16 + [180.0, 104.0] + [100.0] * 12
    _log(tmp_path / 'f-none-1.log', times, skipped=range(1, 17))
    rc, out, _ = _table(tmp_path)
    assert rc == 0
    assert '| f | none | 1* | 1.80 (1.80) | 1.04 (1.04) | 1.00 (1.00) |' in out
    assert 'steady is the median of the stepped iterations after the first five' in out


def test_incomplete_log_is_an_error(tmp_path):
    _log(tmp_path / 'm-none-1.log', [100.0] * 12)
    rc, _, err = _table(tmp_path)
    assert rc == 1
    assert 'm-none-' in err and 'incomplete (12 stepped iterations)' in err


def test_committed_h200_table_is_what_its_logs_give():
    results = TOOL.parents[2] / 'tests' / 'evidence' / 'data' / 'first-five-h200-2026-12-05'
    rc, out, err = _table(results)
    assert rc == 0, err
    assert out == (results / 'table.md').read_text()
