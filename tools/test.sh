#!/usr/bin/env bash
# The README's test command: set up .venv from nothing (tools/install.sh) and run the CPU suite.
#   tools/test.sh [pytest args...]
# Exit status: pytest's, except that "no tests collected" (pytest's 5) is a failure with a message.
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install.sh --test-deps || exit $?
start=$(date +%s)
.venv/bin/python -m pytest tests -q -ra -p no:cacheprovider "$@"
rc=$?
echo "CPU suite wall time: $(( $(date +%s) - start )) s"
if [ "$rc" = 5 ]; then
  echo "tools/test.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit "$rc"
