#!/usr/bin/env bash
# Steady-state step time, fork against pristine, through upstream's own pretrain_gpt.py with
# --overlap-grad-reduce and gradient accumulation on one GPU (patch 0013: the schedules now call
# DistributedDataParallel.set_num_microbatches() before every forward/backward call).
# Written for the lead to run on one H200; not run on CPU.
#
#   tools/maint/step_time_vmb.sh FORK_TREE PRISTINE_TREE MLM_DIR [REPEATS]
#
# FORK_TREE / PRISTINE_TREE: directories holding megatron/ (e.g. the repository root after
# `tools/fork.py materialize --base 0.19.2`, and build/trees/pristine-0.19.2); they go on
# PYTHONPATH. A tree whose megatron/core/datasets has no Makefile (the wheel ships only the
# compiled helper) is copied to a scratch folder with a no-op Makefile there, so that pristine's
# compile_helpers() does not exit 1 (patch 0012); nothing else in the tree changes.
# MLM_DIR: pretrain_gpt.py, gpt_builders.py and model_provider.py from the base's Megatron-LM tag
# (git archive, never committed). Model: 12 layers / hidden 2048 / seq 2048, micro batch 2,
# global batch 8 (4 microbatches per step), bf16, 40 iterations; REPEATS (default 3) fresh
# processes per arm, arms interleaved (fork, pristine, fork, ...) so drift hits both.
# DISTOPT=1 adds --use-distributed-optimizer; EXTRA adds arguments to every run. Logs go to $OUT
# (or build/step-time-vmb); the summary prints each run's median iteration time over iterations
# 11-40 and the fork/pristine ratio of the medians of those medians.
set -uo pipefail
fork=$(realpath "$1") pristine=$(realpath "$2") mlm=$(realpath "$3") repeats=${4:-3}
out=${OUT:-$PWD/build/step-time-vmb}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

with_makefile() {  # with_makefile NAME TREE: TREE, or a copy of it with a no-op datasets Makefile
  if [ -f "$2/megatron/core/datasets/Makefile" ]; then
    echo "$2"
  else
    mkdir -p "$work/$1" && cp -r "$2/megatron" "$work/$1/"
    printf 'all:\n\t@true\n' >"$work/$1/megatron/core/datasets/Makefile"
    echo "$work/$1"
  fi
}
declare -A tree=([fork]=$(with_makefile fork "$fork") [pristine]=$(with_makefile pristine "$pristine"))

args=(
  --num-layers 12 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 8 --train-iters 40
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --bf16 --seed 1234
  --overlap-grad-reduce --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-persist-layer-norm --eval-iters 0 --eval-interval 1000 --log-interval 1
)
[ -n "${DISTOPT:-}" ] && args+=(--use-distributed-optimizer)

for rep in $(seq 1 "$repeats"); do
  for arm in fork pristine; do
    log="$out/$arm-$rep.log"
    (cd "$mlm" && PYTHONPATH="${tree[$arm]}" NO_VCS_VERSION=0 python3 -m torch.distributed.run \
      --nproc_per_node 1 --master_port 29512 pretrain_gpt.py "${args[@]}" ${EXTRA:-}) >"$log" 2>&1
    echo "== $arm $rep: rc $?"
  done
done

python3 - "$out" "$repeats" <<'EOF'
import re, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
medians = {}
for arm in ('fork', 'pristine'):
    for rep in range(1, repeats + 1):
        text = open(f'{out}/{arm}-{rep}.log', errors='replace').read()
        times = {
            int(i): float(ms)
            for i, ms in re.findall(
                r'iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)', text
            )
        }
        losses = re.findall(r'iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)', text)
        steady = [times[i] for i in range(11, 41) if i in times]
        if not steady:
            print(f'{arm} {rep}: no iteration times (see {out}/{arm}-{rep}.log)')
            continue
        medians.setdefault(arm, []).append(statistics.median(steady))
        print(f'{arm} {rep}: median {statistics.median(steady):.2f} ms over {len(steady)} '
              f'iterations, last loss {losses[-1][1] if losses else "n/a"}')
if len(medians) == 2:
    f, p = statistics.median(medians['fork']), statistics.median(medians['pristine'])
    print(f'fork {f:.2f} ms, pristine {p:.2f} ms, fork/pristine {f / p:.4f} '
          f'(range of runs: fork {min(medians["fork"]):.2f}-{max(medians["fork"]):.2f}, '
          f'pristine {min(medians["pristine"]):.2f}-{max(medians["pristine"]):.2f})')
EOF
