#!/usr/bin/env bash
# GPU evidence in ONE device call: the world-1 GPU tier of the test suite (nccl) and the warmup
# benchmark (tools/maint/bench_warmup.py) at two model sizes; logs and JSON land in $OUT.
#
# Usage (repository root; megatron/ and build/trees/pristine-0.18.2/megatron must exist there):
#   tools/maint/gpu_evidence.sh                      # on the GPU machine
#   GPU_EVIDENCE_DRY=1 tools/maint/gpu_evidence.sh   # dry run on CPU: gloo, tiny sizes, one quick test
#
# Environment:
#   OUT                   output folder (default /tmp/gpu-evidence); at most 8 files land there.
#   PYTHON                interpreter (default python3).
#   GPU_EVIDENCE_DRY      1: CPU dry run.
#   GPU_EVIDENCE_K        pytest -k expression (default: the world-1 scenarios, see below).
#   GPU_EVIDENCE_REPEATS  fresh processes per benchmark arm (default 3).
#   GPU_EVIDENCE_SKIP     comma list of stages to skip: tests,small,large.
#   Wheels for missing pyyaml/einops/pytest: put them in .whl/ (carried) and they are installed
#   with pip --no-index.
# Exit status: 0 when every stage passed, else 1 (all stages run regardless).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-evidence}
DRY=${GPU_EVIDENCE_DRY:-0}
REPEATS=${GPU_EVIDENCE_REPEATS:-3}
SKIP=",${GPU_EVIDENCE_SKIP:-},"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# Multi-GPU hosts here must keep NVLink multicast off; harmless on one GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
declare -A RC
elapsed() { echo $(( $(date +%s) - T0 )); }

# ---- environment ------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  dry: $DRY"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo n/a)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null \
    || rocm-smi --showproductname --showdriverversion 2>/dev/null || echo "no GPU tool"
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "hip", getattr(torch.version, "hip", None),
"gpus", torch.cuda.device_count())'
  base=$("$PY" tools/fork.py base --materialized 2>/dev/null || echo '?')
  echo "base: $base; series: $("$PY" tools/fork.py series --base "$base" 2>/dev/null | tr '\n' ' ')"
} 2>&1 | tee "$OUT/env.txt"

for tree in megatron/core build/trees/pristine-0.18.2/megatron/core; do
  if [ ! -d "$tree" ]; then
    echo "MISSING $tree: the device call must carry megatron and build/trees/pristine-0.18.2/megatron" \
      | tee -a "$OUT/env.txt"
    exit 2
  fi
done

# ---- python packages the suite needs ----------------------------------------------------------
missing=$("$PY" - <<'EOF'
import importlib
names = {'yaml': 'pyyaml', 'einops': 'einops', 'pytest': 'pytest'}
print(' '.join(pkg for mod, pkg in names.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "missing python packages: $missing" | tee -a "$OUT/env.txt"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    "$PY" -m pip install -q $missing || echo "pip install failed: carry wheels for: $missing in .whl/"
  fi
fi

# ---- 1. GPU tier of the test suite (world-1 scenarios) ----------------------------------------
# Call-based tests (tests.harness.call) skip worlds larger than the GPU count by themselves;
# test_ddp_calibration launches worlds directly, so only its world-1 parametrizations are picked.
DEFAULT_K='test_warmup or test_ddp_training or test_harness or (test_ddp_calibration and (-1] or [1])) or (test_expert_grad_stats and 1])'
FILES=""
for f in tests/test_warmup.py tests/test_ddp_training.py tests/test_harness.py \
         tests/test_ddp_calibration.py tests/test_expert_grad_stats.py; do
  [ -f "$f" ] && FILES="$FILES $f"
done
if [ "$DRY" = 1 ]; then
  BACKEND=gloo
  K=${GPU_EVIDENCE_K:-'test_bad_input or test_unknown_tree_label'}
else
  BACKEND=nccl
  K=${GPU_EVIDENCE_K:-$DEFAULT_K}
fi
if [[ "$SKIP" != *,tests,* ]]; then
  echo "== tests ($BACKEND): pytest$FILES -m 'not slow' -k '$K'  [t=$(elapsed)s]"
  rm -rf /tmp/harness-w*
  FORK_TEST_BACKEND=$BACKEND FORK_TEST_WORLD_TIMEOUT=${FORK_TEST_WORLD_TIMEOUT:-140} \
    timeout "${GPU_EVIDENCE_TEST_TIMEOUT:-150}" "$PY" -m pytest $FILES -q -ra -p no:cacheprovider -m "not slow" -k "$K" \
    2>&1 | tee "$OUT/pytest.log"
  RC[tests]=${PIPESTATUS[0]}
  tar czf "$OUT/harness-logs.tgz" /tmp/harness-w* 2>/dev/null || true
fi

# ---- 2./3. benchmark: small and large model ---------------------------------------------------
# Stage budgets (s): tests 150, small 150, large 220 => under 9 minutes even when all time out;
# --max-seconds stops starting repeats early, --timeout bounds one arm process.
bench() {  # name timeout max_seconds args...
  local name=$1 tmo=$2 maxs=$3
  shift 3
  echo "== bench $name [t=$(elapsed)s]"
  timeout "$tmo" "$PY" tools/maint/bench_warmup.py --timeout $((tmo / 2)) --fork-tree . \
    --pristine-tree build/trees/pristine-0.18.2 --out "$OUT/bench-$name.json" \
    --repeats "$REPEATS" --max-seconds "$maxs" --label "gpu_evidence $name" "$@" \
    2>&1 | tee "$OUT/bench-$name.log"
  RC[$name]=${PIPESTATUS[0]}
}
if [ "$DRY" = 1 ]; then
  SMALL=(--device cpu --layers 2 --hidden 64 --seq 32 --vocab 128 --accum 2 --steps 4 --steady-skip 1)
  LARGE=(--device cpu --layers 2 --hidden 128 --seq 64 --vocab 256 --accum 2 --steps 3 --steady-skip 1)
  [ "${GPU_EVIDENCE_REPEATS:-}" ] || REPEATS=1
else
  SMALL=(--device cuda --layers 4 --hidden 1024 --seq 1024 --accum 2 --micro-batch 1 --steps 20)
  LARGE=(--device cuda --layers 12 --hidden 2048 --seq 2048 --accum 2 --micro-batch 1 --steps 30)
fi
[[ "$SKIP" == *,small,* ]] || bench small "${GPU_EVIDENCE_SMALL_TIMEOUT:-150}" "${GPU_EVIDENCE_SMALL_MAX:-110}" "${SMALL[@]}"
[[ "$SKIP" == *,large,* ]] || bench large "${GPU_EVIDENCE_LARGE_TIMEOUT:-220}" "${GPU_EVIDENCE_LARGE_MAX:-160}" "${LARGE[@]}"

# ---- summary ------------------------------------------------------------------------------------
{
  echo
  echo "== summary (wall $(elapsed)s)"
  for stage in tests small large; do
    [ -n "${RC[$stage]+x}" ] && echo "stage $stage: rc ${RC[$stage]}"
  done
  grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$OUT/pytest.log" 2>/dev/null | tail -1
  "$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
gib = 2**30
def f(s, k=1.0, d=3):
    return '-' if not s else f"{s['median'] * k:.{d}f} [{s['min'] * k:.{d}f}-{s['max'] * k:.{d}f}]"
rows = []
for name in ('small', 'large'):
    path = os.path.join(out, f'bench-{name}.json')
    if not os.path.exists(path):
        continue
    d = json.load(open(path))
    c, s, e = d['config'], d['summary'], d['environment']
    print(f"\n{name}: {c['layers']}L h{c['hidden']} s{c['seq']} accum{c['accum']} | "
          f"{e['gpu_name'] or 'CPU'} driver {e['driver']} torch {e['torch']} | "
          f"repeats {s['repeats']} complete {d['complete']}")
    print(f"  {'arm':<12} {'first s':>24} {'steady s':>24} {'first/steady':>18} {'peak GiB':>20}")
    for arm, a in s['arms'].items():
        print(f"  {arm:<12} {f(a['first_step_s'], d=4):>24} {f(a['steady_step_s'], d=4):>24} "
              f"{f(a['first_over_steady'], d=2):>18} {f(a['peak_allocated_bytes'], 1 / gib, 2):>20}")
    r = s['ratios']
    w = s['arms'].get('fork+warmup', {}).get('warmup_wall_s')
    print(f"  steady fork/pristine {f(r['steady_fork_over_pristine'], d=4)} | "
          f"peak fork+warmup/fork {f(r['peak_forkwarmup_over_fork'], d=4)} | "
          f"warmup+restore s {f(w, d=2)} | "
          f"max|dloss| {s['max_abs_loss_diff_fork_vs_forkwarmup']} "
          f"(fork repeats {s.get('max_abs_loss_diff_between_fork_repeats')})")
EOF
  ls -la "$OUT"
} 2>&1 | tee "$OUT/summary.txt"

for stage in "${!RC[@]}"; do
  [ "${RC[$stage]}" = 0 ] || exit 1
done
exit 0
