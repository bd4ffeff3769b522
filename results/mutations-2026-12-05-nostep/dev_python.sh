#!/bin/sh
# The interpreter that tools/maint/mutate.py runs pytest with (--python): the worktree's Python,
# inside the dev clone named by FORK_DEV_CLONE, with the CPU ranks' plugin (results/dev-unit-tests).
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$FORK_DEV_CLONE" || exit 2
FORK_CPU_REDIRECT="$repo/tests/harness/cpu_redirect.py" PYTHONPATH="$repo/results/dev-unit-tests" \
  exec "$repo/.venv/bin/python" "$@"
