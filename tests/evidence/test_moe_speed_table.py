"""tools/maint/moe_speed_table.py on synthetic pretrain_gpt.py logs: recompile lines belong to
the iteration whose line follows them (or to the warmup before its ``[warmup] Ran`` line), the
steady step is the median of iterations 11 to the last, and the per-repeat ratios pair the arms
of one repeat."""

import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[2] / 'tools' / 'maint' / 'moe_speed_table.py'
RECOMPILE = (
    'V1206 guards.py:5396] [1/1] [__recompiles] Recompiling function {fn} in '
    'megatron/core/fusions/fused_bias_swiglu.py:45'
)


def _log(path, times, recompiles=None, warmup=None, loss_shift=0.0):
    lines = []
    if warmup is not None:
        lines += [RECOMPILE.format(fn='weighted_swiglu')] * warmup
        lines.append(
            '[warmup] Ran 5 warmup train steps in 9.00s (first step 5.00s; '
            f'{warmup} torch.compile compilations) and restored the model'
        )
    for it, ms in enumerate(times, 1):
        lines += [RECOMPILE.format(fn='weighted_swiglu_back')] * (recompiles or {}).get(it, 0)
        lines.append(
            f' [2026-12-06] iteration {it:8d}/      30 | consumed samples: {2 * it} | elapsed time '
            f'per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | lm loss: '
            f'{10 - it * 0.01 + loss_shift:.6E} |'
        )
    path.write_text('\n'.join(lines) + '\n')


def _table(log_dir):
    run = subprocess.run([sys.executable, str(TOOL), str(log_dir)], capture_output=True, text=True)
    return run.returncode, run.stdout, run.stderr


def _row(out, *cells):
    [line] = [
        ln
        for ln in out.splitlines()
        if [c.strip() for c in ln.split('|')[1:4]][: len(cells)] == list(cells)
    ]
    return [c.strip() for c in line.split('|')[1:-1]]


def test_runs_and_ratios(tmp_path):
    steady = [100.0] * 30
    pristine = [2000.0, 300.0, 100.0, 400.0] + steady[4:]
    _log(tmp_path / 'ag8-pristine-a1.log', pristine, recompiles={1: 9, 4: 6})
    _log(tmp_path / 'ag8-eager-a1.log', [80.0] * 30, loss_shift=1e-3)
    _log(tmp_path / 'ag8-fork-a1.log', [1500.0] + [78.0] * 29, recompiles={1: 2})
    _log(tmp_path / 'ag8-fork-warmup5-a1.log', [82.0] + [78.0] * 29, warmup=3)
    rc, out, err = _table(tmp_path)
    assert rc == 0, err
    assert _row(out, 'ag8', 'pristine', 'a1')[3:6] == [
        '100.0',
        '20.00 3.00 1.00 4.00 1.00',
        '1: 9, 4: 6',
    ]
    assert _row(out, 'ag8', 'fork', 'a1')[5] == '1: 2'
    warm = _row(out, 'ag8', 'fork-warmup5', 'a1')
    assert warm[4].split()[0] == '1.05' and warm[5] == 'none' and warm[6] == '3 / 3'
    assert warm[7] == '0 of 20', warm
    ratios = _row(out, 'ag8', 'a1')
    assert ratios[2:4] == ['0.780', '0.975'], ratios
    assert ratios[4] == f'0.0e+00; {1e-3 / (10 - 0.01):.1e}', ratios


def test_steady_spread(tmp_path):
    # 20 steady iterations (11-30), median 100: 86 and 111 are over 1.10 of it, 110 is not
    steady = [100.0] * 14 + [110.0, 111.0, 86.0, 95.0, 90.0, 120.0]
    _log(tmp_path / 'a2a8-fork-warmup5-z1.log', [105.0] * 10 + steady, warmup=3)
    rc, out, err = _table(tmp_path)
    assert rc == 0, err
    row = _row(out, 'a2a8', 'fork-warmup5', 'z1')
    assert row[3] == '100.0' and row[7] == '2 of 20', row


def test_no_logs_is_an_error(tmp_path):
    rc, _, err = _table(tmp_path)
    assert rc == 2 and 'no <model>-<arm>-<tag><rep>.log' in err
