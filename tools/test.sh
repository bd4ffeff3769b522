#!/usr/bin/env bash
# The README's test command: set up .venv from nothing (tools/install.sh) and run the CPU suite.
#   tools/test.sh                  CI plan: the whole suite on the default base (the newest
#                                  release), then the counterfactual files on every other
#                                  maintained release under a non-native ATEN_CPU_CAPABILITY
#                                  (avx2 on an AVX512 CPU, else default: other kernels round as
#                                  another CPU would), then (if FORK_TEST_DEV_REPO names a
#                                  Megatron-LM checkout) the counterfactual files on dev; last,
#                                  the skips of all runs per tier
#   tools/test.sh [pytest args...] only pytest with these args, on FORK_TEST_BASE (default: the
#                                  default base)
# Exit status: pytest's (the first failing run's), except that "no tests collected" (pytest's 5)
# is a failure with a message.
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install.sh --test-deps || exit $?
py=.venv/bin/python
default=$($py tools/fork.py base --default) || exit $?
releases=$($py tools/fork.py base --releases) || exit $?
# The counterfactual files (each arm runs the real upstream code of the selected base): the
# top-level test files that patches/changes.toml names for its changes, one list for every job.
mapfile -t counterfactual < <($py tools/fork.py tests)
if [ "${#counterfactual[@]}" = 0 ]; then
  echo "tools/test.sh: tools/fork.py tests named no counterfactual file (patches/changes.toml)" >&2
  exit 1
fi
# (test_expert_gtp_grads.py skips itself on bases without generalized TP: dev and 0.18.2.)
# Every skip names an optional tier (tests/harness/tiers.py); the runs append theirs here.
skip_log=$(mktemp)
trap 'rm -f "$skip_log"' EXIT
export FORK_TEST_SKIP_LOG="$skip_log"

run() {  # run BASE pytest-args...: one pytest run on one base, with its wall time
  local base=$1 t0 rc
  shift
  t0=$(date +%s)
  echo "==> base $base: pytest $*"
  FORK_TEST_BASE="$base" $py -m pytest -q -ra -p no:cacheprovider "$@"
  rc=$?
  echo "base $base wall time: $(( $(date +%s) - t0 )) s"
  if [ "$rc" = 5 ]; then
    echo "tools/test.sh: pytest collected no tests on base $base; that is a failure here" >&2
    rc=1
  fi
  return "$rc"
}

# One capability below the native one: AVX512 -> avx2, else default. (torch 2.14.1's inductor
# emits vectorized C++ it cannot compile under ATEN_CPU_CAPABILITY=default on an AVX512 CPU;
# docs/maintaining.md "Test tiers" says so.) The other releases' passes run under it, so one
# pass checks both another base and another CPU's rounding (a separate rounding pass on the
# default base took a third of CI's 30 minutes).
other_capability() {
  local native
  native=$($py -c 'import torch; print(torch.backends.cpu.get_cpu_capability())') || return 1
  if [ "$native" = AVX512 ]; then echo avx2; else echo default; fi
}

start=$(date +%s)
status=0
if [ $# -gt 0 ]; then
  run "${FORK_TEST_BASE:-$default}" "$@" || status=$?
else
  run "$default" tests || status=$?
  other=$(other_capability) || exit 1
  # Its own inductor cache: no kernel compiled in the native run stands in for this pass's.
  # (Sharing the cache, 2026-12-05: 132 ranks segfaulted in a compiled jit_fuser kernel.)
  inductor_cache=$(mktemp -d)
  for base in $releases; do
    [ "$base" = "$default" ] && continue
    echo "==> ATEN_CPU_CAPABILITY=$other on base $base"
    ATEN_CPU_CAPABILITY=$other TORCHINDUCTOR_CACHE_DIR=$inductor_cache \
      run "$base" "${counterfactual[@]}" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
  done
  rm -rf "$inductor_cache"
  if [ -n "${FORK_TEST_DEV_REPO:-}" ]; then
    run dev "${counterfactual[@]}" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
  else
    echo "(dev tier skipped: set FORK_TEST_DEV_REPO to a Megatron-LM checkout to run it)"
  fi
fi
$py - "$skip_log" <<'PY'
import collections, json, sys
total = collections.Counter()
for line in open(sys.argv[1], encoding='utf-8'):
    total.update(json.loads(line)['skips'])
print('skips by optional tier, all runs:', ', '.join(f'{t} {n}' for t, n in sorted(total.items())) or 'none')
PY
echo "CPU suite wall time: $(( $(date +%s) - start )) s"
exit "$status"
