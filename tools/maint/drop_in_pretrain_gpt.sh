#!/usr/bin/env bash
# Upstream's own pretrain_gpt.py against an installed drop-in (and against the pristine wheel).
#
#   tools/maint/drop_in_pretrain_gpt.sh FORK_WHEEL PRISTINE_WHEEL MLM_DIR [DEP_WHEEL_DIR]
#
# FORK_WHEEL: the fork built with `pip wheel --no-deps --no-build-isolation .`; PRISTINE_WHEEL: the
# pinned upstream wheel (~/.cache/megatron-fork); MLM_DIR: pretrain_gpt.py, gpt_builders.py and
# model_provider.py from the Megatron-LM tag of the base (git archive, never committed);
# DEP_WHEEL_DIR: einops/pyyaml wheels for machines without an index. Each wheel goes into its own
# venv (the running python3's site-packages are appended, so the machine's torch is used) outside the repository, so nothing
# imports the materialized tree. Arms: pristine (expected to exit 1 in compile_helpers), fork
# without warmup, fork with --warmup-train-steps 2. Logs go to $OUT (or
# build/drop-in-logs); the losses are printed per iteration.
set -uo pipefail
fork_whl=$(realpath "$1") pristine_whl=$(realpath "$2") mlm=$(realpath "$3") deps=${4:+$(realpath "$4")}
out=${OUT:-$PWD/build/drop-in-logs}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

install() {  # install VENV WHEEL
  python3 -m venv "$1"
  # The machine's torch may itself live in a venv: make its site-packages visible (after ours).
  python3 -c 'import site; print(site.getsitepackages()[0])' \
    >"$("$1/bin/python" -c 'import site; print(site.getsitepackages()[0])')/machine-site.pth"
  "$1/bin/pip" install -q --no-deps --disable-pip-version-check "$2" ${deps:+"$deps"/*.whl} ||
    "$1/bin/pip" install -q --disable-pip-version-check "$2" einops pyyaml
}

args=(
  --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
  --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 --train-iters 12
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --bf16 --seed 1234
  --use-distributed-optimizer --overlap-grad-reduce --mock-data --tokenizer-type NullTokenizer
  --vocab-size 32000 --transformer-impl local --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-persist-layer-norm --eval-iters 0 --eval-interval 1000
  --log-interval 1
)

run() {  # run NAME VENV [extra args]
  local name=$1 venv=$2
  shift 2
  (cd "$mlm" && env -u PYTHONPATH NO_VCS_VERSION=0 "$venv/bin/python" -m torch.distributed.run \
    --nproc_per_node 1 --master_port 29511 pretrain_gpt.py "${args[@]}" "$@") >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc"
  grep -o 'iteration *[0-9]*/ *[0-9]* |.*elapsed time per iteration (ms): [0-9.]*\|lm loss: [0-9.E+-]*' \
    "$out/$name.log" | paste - - | sed -E 's/ \| consumed.*elapsed time per iteration \(ms\): / ms /' || true
  grep -m1 -E 'makefile|Error|error:' "$out/$name.log" || true
}

install "$work/pristine" "$pristine_whl"
install "$work/fork" "$fork_whl"
(cd / && "$work/fork/bin/python" -c 'import megatron.core as m; print("fork megatron.core", m.__version__, m.__file__)')
run pristine "$work/pristine"
run fork-nowarmup "$work/fork"
run fork-warmup2 "$work/fork" --warmup-train-steps 2
