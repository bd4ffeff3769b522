#!/usr/bin/env bash
# MoE at full speed (issue 38): torch.compile recompiles per real iteration, the first five real
# iterations over steady state, and the steady step of the fork against pristine and against the
# eager fused functions, through upstream's own pretrain_gpt.py on one GPU, arms interleaved.
#
#   tools/maint/gpu_moe_speed.sh FORK_TREE PRISTINE_TREE MLM_DIR [REPEATS]
#
# FORK_TREE, PRISTINE_TREE: directories holding megatron/ (the fork's materialized tree and the
# pristine upstream of the same base), each with the wheel's helpers_cpp extension in
# megatron/core/datasets/ (pristine also needs a Makefile there: upstream's compile_helpers()
# runs make). MLM_DIR: pretrain_gpt.py, gpt_builders.py and model_provider.py of the base's
# Megatron-LM ref (git archive, never committed).
#
# Models (8 layers, hidden 1024, 16 heads, sequence 2048, micro-batch 1, global batch 2, bf16,
# distributed optimizer with --overlap-grad-reduce, 30 iterations, log interval 1, local spec):
#   ag8   8 local experts (SequentialMLP), top-2, allgather dispatcher, SwiGLU, no linear biases
#   a2a8  the same with the alltoall dispatcher
#   ag4   4 experts, allgather;  a2a4  4 experts, alltoall
#   dense the same model without experts (SwiGLU MLP): the control
# Arms: pristine (PRISTINE_TREE, compiled), eager (PRISTINE_TREE, TORCHDYNAMO_DISABLE=1: the
# eager fused functions), fork (FORK_TREE), fork-warmup5 (FORK_TREE, --warmup-train-steps 5),
# alt (the tree ALT_TREE names: a candidate), fork-eager (FORK_TREE, TORCHDYNAMO_DISABLE=1: what the
# fork costs outside the compiled functions).
# PROFILE=START:END profiles real iterations START+1..END with upstream's torch.profiler flags
# (--profile --use-pytorch-profiler) and writes tools/maint/trace_summary.py's summary of the
# trace next to the log (<name>.trace.txt); the trace itself is left in <name>.tb/../torch_profile.
# Every arm logs dynamo's recompiles (TORCH_LOGS=recompiles). MODELS="..." and ARMS="..." choose;
# the loop runs repeat by repeat, model by model, so the arms of one model run back to back.
# Logs: $OUT (default build/moe-speed-logs)/<model>-<arm>-<TAG><rep>.log;
# tools/maint/moe_speed_table.py makes the table.
# DEADLINE (epoch seconds): start no run after it (the runs left out are named).
# GC_PROBE=1 puts tools/maint/gc_probe/ on PYTHONPATH: every full garbage collection is logged
# as it ends ([gc] gen2 ...) and each generation's count and time at exit ([gc] totals ...).
# PROBE=DIR puts DIR first on PYTHONPATH (a sitecustomize.py of a measurement; it wins over
# GC_PROBE's): PROBE=tools/maint/step_probe logs each train step's time, the gap to the previous
# one, data and gc time and the allocator's cudaMallocs ([probe] lines).
# EXTRA="--manual-gc" runs upstream's own manual collection instead (an arm to compare).
# EXTRA="--lr 0 --min-lr 0" keeps the model, and so its routing, as initialised: without load
# balancing the router concentrates its tokens as the model trains, which makes later steps
# cheaper (docs/warmup.md, "Where it stands"); at lr 0 first five over steady compares like with
# like. EXTRA="--moe-aux-loss-coeff 1e-2" balances it instead, as most MoE runs do.
set -uo pipefail
fork=$(realpath "$1") pristine=$(realpath "$2") mlm=$(realpath "$3") repeats=${4:-2}
out=${OUT:-$PWD/build/moe-speed-logs}
mkdir -p "$out"

common=(
  --micro-batch-size 1 --global-batch-size 2 --train-iters ${ITERS:-30} --lr 1e-4 --min-lr 1e-5
  --lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --bf16 --use-distributed-optimizer
  --overlap-grad-reduce --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-persist-layer-norm --eval-iters 0 --eval-interval 1000 --log-interval 1
  --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --swiglu --disable-bias-linear
)
ag8=(--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type allgather)
a2a8=(--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall)
ag4=(--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type allgather)
a2a4=(--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall)
dense=()

for rep in $(seq 1 "$repeats"); do
  for model in ${MODELS:-ag8 a2a8}; do
    for arm in ${ARMS:-pristine eager fork fork-warmup5}; do
      declare -n shape=$model
      if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
        echo "== $model $arm $rep: not run (DEADLINE)"
        continue
      fi
      tree=$fork extra=() env_extra=()
      case $arm in
        pristine) tree=$pristine ;;
        eager) tree=$pristine env_extra=(TORCHDYNAMO_DISABLE=1) ;;
        fork) ;;
        fork-eager) env_extra=(TORCHDYNAMO_DISABLE=1) ;;
        alt) tree=${ALT_TREE:?the alt arm runs the tree ALT_TREE names} ;;
        fork-warmup*) extra=(--warmup-train-steps "${arm#fork-warmup}") ;;
        *) echo "unknown arm $arm" >&2; exit 2 ;;
      esac
      name="$out/$model-$arm-${TAG:-r}$rep"
      if [ -n "${PROFILE:-}" ]; then
        extra+=(--profile --use-pytorch-profiler --profile-step-start "${PROFILE%:*}"
          --profile-step-end "${PROFILE#*:}" --tensorboard-dir "$name.prof/tb")
      fi
      started=$(date +%s)
      pythonpath=$tree
      [ "${GC_PROBE:-0}" = 1 ] && pythonpath="$tree:$(cd "$(dirname "$0")" && pwd)/gc_probe"
      [ -n "${PROBE:-}" ] && pythonpath="$(realpath "$PROBE"):$pythonpath"
      (cd "$mlm" && env PYTHONPATH="$pythonpath" PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles \
        "${env_extra[@]}" python3 -m torch.distributed.run --nproc_per_node 1 \
        --master_port 29512 pretrain_gpt.py "${common[@]}" "${shape[@]}" "${extra[@]}" \
        ${EXTRA:-}) >"$name.log" 2>&1
      echo "== $model $arm $rep: rc $? in $(( $(date +%s) - started )) s"
      if [ -n "${PROFILE:-}" ]; then
        python3 "$(dirname "$0")/trace_summary.py" "$name.prof"/torch_profile/rank-0.json.gz \
          >"$name.trace.txt" 2>&1
      fi
    done
  done
done
