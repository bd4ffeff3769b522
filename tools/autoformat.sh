#!/usr/bin/env bash
# Format and lint gates of the fork, modelled on upstream Megatron-LM's own gates
# (black 24 with -l 100 --skip-string-normalization --skip-magic-trailing-comma, isort black
# profile, pylint's small enabled subset, ruff).
#
# Usage: tools/autoformat.sh [--check] [--python PY] [--tree DIR]
#   --check      report only; exit 1 on any finding (CI mode). Without it, fix what can be fixed.
#   --python PY  interpreter that has tools/lint-requirements.txt installed (default: $PYTHON,
#                else python3).
#   --tree DIR   directory holding the materialized megatron/ (default: the repository root).
#
# What it covers:
#   * the fork's own code: tools/, tests/ (minus tests/vendor/) and setup.py, whole files;
#   * in the materialized tree, only the files that the series of megatron/'s base (patches/<base>/) touches:
#       - files the series creates are ours: whole-file gates;
#       - upstream files the series modifies: black and isort whole-file when the pristine
#         upstream file already passes them, otherwise only where their diff meets a line the
#         series added or removed; pylint and ruff findings count only on lines the series added.
#     The pristine copy of each touched file is rebuilt by reverse-applying the series, so the
#     tree must be materialized from the current patches/ (python tools/fork.py materialize).
# No network access. Exit status: 0 clean (or fixed), 1 findings, 2 usage or setup error.
# The gates themselves are tools/autoformat.py; this wrapper checks the tools are installed.
set -euo pipefail

REPO_ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." &>/dev/null && pwd)
CHECK=0
PY=${PYTHON:-python3}
TREE=$REPO_ROOT
while [[ $# -gt 0 ]]; do
    case "$1" in
        --check) CHECK=1 ;;
        --python) PY=$2; shift ;;
        --tree) TREE=$2; shift ;;
        -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "autoformat.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

for mod in black isort pylint ruff; do
    if ! "$PY" -c "import $mod" &>/dev/null; then
        echo "autoformat.sh: $PY lacks '$mod'; run: $PY -m pip install -r tools/lint-requirements.txt" >&2
        exit 2
    fi
done

cd "$REPO_ROOT"
args=()
[[ $CHECK == 1 ]] && args+=(--check)
exec "$PY" tools/autoformat.py "${args[@]}" --tree "$TREE"
