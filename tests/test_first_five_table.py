"""tools/maint/first_five_table.py on synthetic pretrain_gpt.py logs: fp16's skipped iterations are
left out, the ratios are against the median of iterations 10-30, and a warmup arm whose losses
differ from the none arm's is flagged."""

import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[1] / 'tools' / 'maint' / 'first_five_table.py'


def _log(path, times, skipped=(), losses=None):
    lines = []
    for it, ms in enumerate(times, 1):
        loss = (losses or {}).get(it, f'{10 - it * 0.01:.6E}')
        norm = '' if it in skipped else ' grad norm: 1.000 |'
        lines.append(
            f' [2026-12-04] iteration {it:8d}/      30 | consumed samples: {4 * it} | elapsed time '
            f'per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | lm loss: {loss} | loss '
            f'scale: 1.0 |{norm} number of skipped iterations: 0 |'
        )
    path.write_text('\n'.join(lines) + '\n')


def _table(*dirs):
    cmd = [sys.executable, str(TOOL), *map(str, dirs)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    return run.returncode, run.stdout


def test_ratios_skip_fp16_overflow_steps_and_flag_changed_losses(tmp_path):
    steady = [100.0] * 30
    _log(tmp_path / 'm-none-1.log', [300.0, 150.0, 120.0, 110.0, 101.0] + steady[5:])
    # fp16: iterations 1 and 2 skipped by the scaler (no grad norm): the first stepped one is 3.
    _log(tmp_path / 'm-warmup2-1.log', [500.0, 400.0, 104.0] + steady[3:], skipped=(1, 2))
    _log(tmp_path / 'm-warmup5-1.log', steady, losses={7: '1.000000E+00'})
    rc, out = _table(tmp_path)
    assert rc == 0
    rows = {tuple(c.strip() for c in line.split('|')[1:3]): line for line in out.splitlines()}
    assert '| 3.00 (3.00) | 1.50 (1.50) | 1.20 (1.20) | 1.10 (1.10) | 1.01 (1.01) | 1/5 | - |' in (
        rows[('m', 'none')]
    )
    assert '| 1.04 (1.04) | 1.00 (1.00) |' in rows[('m', 'warmup2')]
    assert rows[('m', 'warmup2')].endswith('| 5/5 | yes |')
    assert rows[('m', 'warmup5')].endswith('| 5/5 | NO |')
    assert rows[('m', 'control (none, it 6-10)')].endswith('| 5/5 | - |')


def test_incomplete_log_is_an_error(tmp_path):
    _log(tmp_path / 'm-none-1.log', [100.0] * 12)
    rc, _ = _table(tmp_path)
    assert rc == 1
