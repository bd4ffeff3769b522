#!/usr/bin/env bash
# First real iterations against steady state, through upstream's own pretrain_gpt.py (issue 14).
#
#   tools/maint/gpu_first_step.sh TREE MLM_DIR [REPEATS]
#
# TREE: a materialized fork tree (build/trees/fork-0.19.2: megatron/ on PYTHONPATH); MLM_DIR:
# pretrain_gpt.py, gpt_builders.py and model_provider.py from the base's Megatron-LM tag (git
# archive, never committed). Two models (small: 4 layers / 512 / seq 1024; large: 12 layers /
# 2048 / seq 2048), accumulation 2, bf16, distributed optimizer, overlap_grad_reduce, 30
# iterations, arms "none" and "warmup2" (--warmup-train-steps 2), REPEATS times each (default 2);
# MODELS="small" or "large" runs one model only; ARMS="warmup2" runs one arm only; EXTRA="--timing-log-level 2" adds arguments to
# every run; TAG names the logs; PROBE=1 runs tools/maint/first_step_probe.py (live allocations
# before the first real step, into $out/<model>-<arm>-<TAG><rep>.probe.json) instead of
# pretrain_gpt.py itself.
# Logs go to $OUT (or build/first-step-logs); tools/maint/first_step_table.py reads them.
set -uo pipefail
tree=$(realpath "$1") mlm=$(realpath "$2") repeats=${3:-2}
out=${OUT:-$PWD/build/first-step-logs}
probe=$(realpath "$(dirname "$0")/first_step_probe.py")
mkdir -p "$out"

common=(
  --micro-batch-size 2 --global-batch-size 4 --train-iters 30 --lr 1e-4 --min-lr 1e-5
  --lr-decay-style cosine --lr-warmup-iters 2 --bf16 --seed 1234 --use-distributed-optimizer
  --overlap-grad-reduce --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-persist-layer-norm --eval-iters 0 --eval-interval 1000 --log-interval 1
)
small=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
  --max-position-embeddings 1024)
large=(--num-layers 12 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048)

for rep in $(seq 1 "$repeats"); do
  for model in ${MODELS:-small large}; do
    for arm in ${ARMS:-none warmup2}; do
      declare -n shape=$model
      extra=()
      [ "$arm" = warmup2 ] && extra=(--warmup-train-steps 2)
      name="$out/$model-$arm-${TAG:-0}$rep"
      script=pretrain_gpt.py
      [ -n "${PROBE:-}" ] && script=$probe
      (cd "$mlm" && PYTHONPATH="$tree" PROBE_OUT="$name.probe.json" NO_VCS_VERSION=0 python3 \
        -m torch.distributed.run --nproc_per_node 1 --master_port 29511 "$script" "${common[@]}" \
        "${shape[@]}" "${extra[@]}" ${EXTRA:-}) >"$name.log" 2>&1
      echo "== $model $arm $rep: rc $?"
    done
  done
done
