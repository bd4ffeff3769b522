#!/usr/bin/env bash
# The one install script of the fork, shared by the README, CI and both container targets.
#
#   tools/install.sh [--base B] [--git-repo R] [--python PY] [--venv DIR | --no-venv]
#                    [--wheel-dir DIR] [--offline] [--no-torch] [--test-deps]
#
#   --base B         the upstream base: a release (0.19.2, 0.18.2; default: the newest, as
#                    patches/upstream.toml `default` says) or dev (needs --git-repo)
#   --git-repo R     a Megatron-LM clone that has the pinned dev commit (for --base dev)
#   --python PY      interpreter to use (default: pyenv 3.12.1 if present, else python3.12)
#   --venv DIR       create/reuse a virtual environment there (default: .venv)
#   --no-venv        install into the active environment (VIRTUAL_ENV/CONDA_PREFIX) or --python
#                    PY's own (containers); refused when neither is given
#   --wheel-dir DIR  directory with the pre-downloaded, hash-pinned upstream wheel
#   --offline        no network: upstream from --wheel-dir or the cache; build deps must be present
#   --no-torch       never install or reinstall torch (containers keep the image's torch)
#   --test-deps      also install tools/requirements-test.txt (the CPU test suite)
#   --print-python   print the interpreter the options select, and exit
#
# It materializes megatron/ (pinned upstream + patches/<base>/series) unless it is already
# current, pip-installs the repo as megatron-core <base>+fork.<N>.g<series digest>, and runs
# `verify --import`.
set -euo pipefail
cd "$(dirname "$0")/.."

py="" venv=".venv" wheel_dir="" offline=0 torch=1 test_deps=0 base="" git_repo="" print_py=0
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --git-repo) git_repo="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    --no-venv) venv=""; shift ;;
    --wheel-dir) wheel_dir="$2"; shift 2 ;;
    --offline) offline=1; shift ;;
    --no-torch) torch=0; shift ;;
    --test-deps) test_deps=1; shift ;;
    --print-python) print_py=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [ -z "$py" ] && [ -z "$venv" ]; then
  # --no-venv installs into an environment someone chose, never silently into the global one.
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    py="$VIRTUAL_ENV/bin/python"
  elif [ -n "${CONDA_PREFIX:-}" ]; then
    py="$CONDA_PREFIX/bin/python"
  else
    echo "install.sh: --no-venv needs an active environment (VIRTUAL_ENV or CONDA_PREFIX) or" \
      "--python PY naming the interpreter to install into" >&2
    exit 2
  fi
fi
if [ -z "$py" ]; then
  # pyenv's own answer, no pipe: `pyenv versions | grep -q` under pipefail failed when grep quit
  # before pyenv had written everything (SIGPIPE), about 1 run in 20.
  if command -v pyenv >/dev/null 2>&1 && pyenv_py=$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null); then
    py="$pyenv_py"
  elif command -v python3.12 >/dev/null 2>&1; then
    py="python3.12"
  else
    py="python3"
  fi
fi
if [ "$print_py" = 1 ]; then
  echo "$py"
  exit 0
fi
if [ -n "$venv" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating virtual environment $venv with $py"
    $py -m venv "$venv"
  fi
  py="$(cd "$venv" && pwd)/bin/python"
fi
$py -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "megatron-core 0.18.2 needs Python >= 3.12, got " + sys.version)'

pip=($py -m pip install --disable-pip-version-check -q)
[ "$offline" = 1 ] && pip+=(--no-index ${wheel_dir:+--find-links "$wheel_dir"})

if [ "$torch" = 1 ] && ! $py -c 'import torch' 2>/dev/null; then
  echo "==> installing torch==2.13.0 (not present)"
  "${pip[@]}" torch==2.13.0
fi
if [ "$offline" = 0 ]; then
  "${pip[@]}" "setuptools>=80" pybind11 "packaging>=24.2" numpy wheel
fi
if [ "$test_deps" = 1 ]; then
  "${pip[@]}" -r tools/requirements-test.txt
fi

if [ -z "$base" ]; then
  base=$($py tools/fork.py base --default)
fi
src=(--base "$base")
[ -n "$wheel_dir" ] && src+=(--wheel-dir "$wheel_dir")
[ "$offline" = 1 ] && src+=(--offline)
[ -n "$git_repo" ] && src+=(--git-repo "$git_repo")
echo "==> materializing megatron/ (pinned upstream $base + patches/$base/series)"
$py tools/fork.py materialize --if-stale "${src[@]}"

echo "==> installing the fork (no torch reinstall, no build isolation)"
# setup.py copies upstream's requirements and extras from the pinned wheel or commit.
MEGATRON_FORK_WHEEL_DIR="$wheel_dir" MEGATRON_FORK_GIT_REPO="$git_repo" \
  "${pip[@]}" --no-deps --no-build-isolation .
"${pip[@]}" pyyaml "einops~=0.8"

echo "==> verify"
(cd / && $py -m megatron_fork.manifest --import)
