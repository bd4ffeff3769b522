#!/bin/bash
# Runs on the device machine: unpacks payload.tgz beside this script (the trees, the dev tests),
# runs offload_repro.py on every tree, the dev unit tests on the dev trees (and the
# release trees), and the mutants of 0040/0041; everything lands in $OUT/logs.tgz.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
SPECS=$HERE/mutations; [ -d $SPECS ] || SPECS=tools/maint/mutations
W=/tmp/w; L=/tmp/logs; mkdir -p $W $L /opt/data && touch /opt/data/.keep
tar xzf $HERE/payload.tgz -C $W
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 PYTHONDONTWRITEBYTECODE=1
(nvidia-smi -L; python3 -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.cuda.get_device_name(0))') > $L/env.txt 2>&1
cat $L/env.txt
TREES=${TREES:-"pristine-0.19.2 fork0023-0.19.2 fork-0.19.2 pristine-0.18.2 fork0023-0.18.2 fork-0.18.2 pristine-dev fork0023-dev fork-dev"}
UT="tests/unit_tests/optimizer/test_cpu_offload_reload_model_params.py tests/unit_tests/dist_checkpointing/test_cpu_offload_step_round_trip.py"
port=29600
run_repro() {  # tree port
  ( start=$(date +%s); PYTHONPATH=$W/trees/$1 MASTER_PORT=$2 timeout 480 python3 $HERE/offload_repro.py \
      --out $L/repro-$1.json --tree-label $1 > $L/repro-$1.log 2>&1; echo "repro $1 rc=$? $(( $(date +%s)-start ))s" >> $L/summary.txt )
}
run_ut() {  # label megatron-tree port
  local d=/tmp/ml-$1; rm -rf $d; mkdir -p /tmp/bt-$1/a; cp -r $W/mltests $d; rm -rf $d/megatron; cp -r $2/megatron $d/megatron
  ( cd $d; start=$(date +%s); MASTER_PORT=$3 timeout 480 python3 -m pytest -p no:cacheprovider -o addopts= -q -rA \
      --basetemp=/tmp/bt-$1/a/b $UT > $L/ut-$1.log 2>&1; echo "ut $1 rc=$? $(( $(date +%s)-start ))s" >> $L/summary.txt )
}
# Mutants of the fork-dev tree.
python3 $HERE/make_mutants.py $W/trees/fork-dev $W/mutants $SPECS/0040.toml $SPECS/0041.toml > $L/mutants.txt 2>&1
# At most $JOBS processes at a time: run 3 started 21 at once on one H100 and most of those that
# saved or loaded a checkpoint failed NCCL's allocations (out of memory).
JOBS=${JOBS:-3}
throttle() { while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done; }
for t in $TREES; do throttle; port=$((port+1)); run_repro $t $port & done
for t in pristine-dev fork0023-dev fork-dev pristine-0.19.2 fork0023-0.19.2 fork-0.19.2; do throttle; port=$((port+1)); run_ut $t $W/trees/$t $port & done
for m in $(cut -d' ' -f1 $L/mutants.txt); do throttle; port=$((port+1)); run_ut mut-$m $W/mutants/$m $port & done
wait
cat $L/summary.txt
for f in $L/ut-*.log; do echo "$f: $(tail -1 $f)"; done
tar czf $OUT/logs.tgz -C $L .
