#!/usr/bin/env bash
# The first five real iterations against steady state for the models users run (issue 25),
# through upstream's own pretrain_gpt.py, arms interleaved in one call.
#
#   tools/maint/gpu_first_five.sh TREE MLM_DIR [REPEATS]
#
# TREE: a materialized fork tree (megatron/ on PYTHONPATH); MLM_DIR: pretrain_gpt.py,
# gpt_builders.py and model_provider.py of the base's Megatron-LM tag (git archive, never
# committed). Models (12 layers / 2048 hidden / seq 2048 unless said; 30 iterations, accumulation
# 2, overlap_grad_reduce, log interval 1):
#   dense  bf16, distributed optimizer
#   moe    8 layers, 8 local experts, top-2, allgather dispatcher, bf16, distributed optimizer
#   fp16   dense with --fp16 (dynamic loss scaling from upstream's default 2^32)
#   ddp    dense without the distributed optimizer
#   opg    dense with --overlap-param-gather
#   accum  dense with accumulation 8
# Arms: none, warmup2, warmup5 (--warmup-train-steps N). MODELS="..." and ARMS="..." choose; the
# loop runs repeat by repeat, model by model, so the arms of one model run back to back.
# Logs: $OUT (default build/first-five-logs)/<model>-<arm>-<TAG><rep>.log;
# tools/maint/first_five_table.py makes the table (losses must equal the none arm's).
# DEADLINE (epoch seconds): start no run after it (a device call has a wall-clock limit; the
# runs left out are named, the logs written so far stay).
set -uo pipefail
tree=$(realpath "$1") mlm=$(realpath "$2") repeats=${3:-2}
out=${OUT:-$PWD/build/first-five-logs}
mkdir -p "$out"

common=(
  --micro-batch-size 2 --train-iters 30 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
  --lr-warmup-iters 2 --seed 1234 --overlap-grad-reduce --mock-data --tokenizer-type NullTokenizer
  --vocab-size 32000 --transformer-impl local --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-persist-layer-norm --eval-iters 0 --eval-interval 1000
  --log-interval 1 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
  --hidden-size 2048
)
dense=(--num-layers 12 --global-batch-size 4 --bf16 --use-distributed-optimizer)
moe=(--num-layers 8 --global-batch-size 4 --bf16 --use-distributed-optimizer --num-experts 8
  --moe-router-topk 2 --moe-token-dispatcher-type allgather --swiglu
  --disable-bias-linear --ffn-hidden-size 2048)
fp16=(--num-layers 12 --global-batch-size 4 --fp16 --use-distributed-optimizer)
ddp=(--num-layers 12 --global-batch-size 4 --bf16)
opg=(--num-layers 12 --global-batch-size 4 --bf16 --use-distributed-optimizer
  --overlap-param-gather)
accum=(--num-layers 12 --global-batch-size 16 --bf16 --use-distributed-optimizer)

for rep in $(seq 1 "$repeats"); do
  for model in ${MODELS:-dense moe fp16 ddp opg accum}; do
    for arm in ${ARMS:-none warmup2 warmup5}; do
      declare -n shape=$model
      if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
        echo "== $model $arm $rep: not run (DEADLINE)"
        continue
      fi
      extra=()
      [ "$arm" != none ] && extra=(--warmup-train-steps "${arm#warmup}")
      name="$out/$model-$arm-${TAG:-r}$rep"
      (cd "$mlm" && PYTHONPATH="$tree" NO_VCS_VERSION=0 python3 -m torch.distributed.run \
        --nproc_per_node 1 --master_port 29512 pretrain_gpt.py "${common[@]}" "${shape[@]}" \
        "${extra[@]}" ${EXTRA:-}) >"$name.log" 2>&1
      echo "== $model $arm $rep: rc $?"
    done
  done
done
