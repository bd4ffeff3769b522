#!/usr/bin/env bash
# The dev patches' upstream-layout unit tests, each against the series without its patch.
#   tools/maint/dev_unit_bisect.sh MEGATRON_LM_DIR [PYTHON]
# MEGATRON_LM_DIR: a Megatron-LM work tree whose HEAD is `git am` of patches/dev/series on the
# pinned dev commit (one commit per patch, in series order; ci.yml's job makes it). For every
# commit that adds files under tests/unit_tests/, it checks out the commit before it, adds those
# test files alone, and runs them (world 1 on CPU: gloo through tests/harness/cpu_redirect.py),
# then the same files at the commit itself. One line per patch:
#   FAILS-WITHOUT  the test fails (or errors) without the patch and passes with it
#   CPU-SKIPS      every case skips on CPU (multi-rank or GPU cases only): nothing shown here
#   PASSES-WITHOUT the test passes without the patch: it cannot catch the patch's removal
#   BROKEN         the test does not pass with its patch
# Exit 1 when any line is PASSES-WITHOUT or BROKEN. The checkout is back at HEAD afterwards.
# DEV_BASE: the commit the series was applied on (default: patches/upstream.toml's dev commit).
set -uo pipefail
mlm=$(cd "$1" && pwd) || exit 2
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${2:-"$here/.venv/bin/python"}
head=$(git -C "$mlm" rev-parse HEAD) || exit 2
base=${DEV_BASE:-}
[ -n "$base" ] || base=$("$py" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["bases"]["dev"]["commit"])' \
  "$here/patches/upstream.toml") || exit 2
# 0049's test needs dynamo outside the redirect's TorchFunctionMode (ci.yml says why).
native=tests/unit_tests/fusions/test_routed_token_fuser.py
# 0056's test builds Megatron-FSDP, which needs the current device as an index on CPU ranks.
mfsdp=tests/unit_tests/distributed/mfsdp_v1/test_mfsdp_single_rank_grad_accumulation.py
trap 'git -C "$mlm" checkout -q -f "$head"' EXIT
# Checkouts a second apart can leave a .pyc that still matches the new source's mtime and size.
export PYTHONDONTWRITEBYTECODE=1
find "$mlm/megatron" "$mlm/tests" -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null

run_tests() {  # run_tests FILE...: pytest's closing line (world 1 on CPU)
  local redirect=(env FORK_CPU_REDIRECT="$here/tests/harness/cpu_redirect.py"
                  PYTHONPATH="$here/tests/harness")
  local plugin=(-p cpu_gloo_plugin)
  if [ "$*" = "$native" ]; then redirect=(env); plugin=(); fi
  if [ "$*" = "$mfsdp" ]; then redirect+=(FORK_CPU_REDIRECT_MODE=megatron_fsdp); fi
  (cd "$mlm" && "${redirect[@]}" "$py" -m pytest "${plugin[@]}" -o addopts= -q \
     -p no:cacheprovider "$@" 2>&1 | tail -1)
}

status=0
for commit in $(git -C "$mlm" rev-list --reverse "$base..$head"); do
  mapfile -t tests < <(git -C "$mlm" diff-tree --no-commit-id --name-only --diff-filter=A -r \
    "$commit" -- tests/unit_tests | grep '/test_[^/]*\.py$')
  [ "${#tests[@]}" = 0 ] && continue
  subject=$(git -C "$mlm" log -1 --format=%s "$commit")
  git -C "$mlm" checkout -q -f "$commit^"
  git -C "$mlm" checkout -q "$commit" -- "${tests[@]}"
  without=$(run_tests "${tests[@]}")
  git -C "$mlm" checkout -q -f "$commit"
  with=$(run_tests "${tests[@]}")
  if [[ "$with" =~ failed|error ]] || ! [[ "$with" =~ passed|skipped ]]; then
    verdict=BROKEN; status=1
  elif ! [[ "$with" =~ passed ]]; then
    verdict=CPU-SKIPS
  elif [[ "$without" =~ failed|error ]]; then
    verdict=FAILS-WITHOUT
  elif ! [[ "$without" =~ passed ]]; then
    verdict=CPU-SKIPS
  else
    verdict=PASSES-WITHOUT; status=1
  fi
  printf '%-14s %s\n    without: %s\n    with:    %s\n' "$verdict" "$subject" "$without" "$with"
done
exit "$status"
