#!/bin/bash
# Recorded as run on 2026-12-03 (paths of that session: /tmp/devtrees2, /work/wt-unit); see ../README.md.
# One H200: upstream-layout tests at world size 1 (upstream's own Utils: NCCL, one GPU), pristine vs fork.
cd "$(dirname "$0")"
mkdir -p /opt/data && touch /opt/data/.present   # upstream conftest downloads test assets otherwise
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
TESTS=$(cut -d' ' -f2 tests.txt | tr '\n' ' ')
for tree in pristine fork; do
  cd $tree
  python3 -c "import megatron.core; print('megatron.core from', megatron.core.__file__)"
  start=$(date +%s)
  PYTHONUNBUFFERED=1 timeout 200 python3 -m pytest -o addopts= -p no:cacheprovider -p no:warnings -rA \
    --continue-on-collection-errors $TESTS > $OUT/gpu-$tree.log 2>&1
  echo "== $tree rc=$? $(( $(date +%s) - start ))s: $(tail -1 $OUT/gpu-$tree.log)"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " $OUT/gpu-$tree.log
  cd ..
done
