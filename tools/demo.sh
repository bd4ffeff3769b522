#!/usr/bin/env bash
# The README's main job: install the fork into .venv, then run pristine upstream against the fork
# on CPU ranks (or on GPUs with NCCL when present) and print a table of results.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install.sh
if .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export FORK_TEST_BACKEND=nccl
fi
exec .venv/bin/python tools/demo.py
