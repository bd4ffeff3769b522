#!/bin/bash
# Recorded as run on 2026-12-03 (paths of that session: /tmp/devtrees2, /work/wt-unit); see ../README.md.
# Per patch N: its test on the tree with patches < N (test file added) and on the tree with <= N.
D=/tmp/devtrees2; F=$D/full; R=$D/results/bisect; mkdir -p $R
PATHS="megatron tests/__init__.py tests/unit_tests tests/test_utils pyproject.toml"
export FORK_CPU_REDIRECT=/work/wt-unit/tests/harness/cpu_redirect.py
export PYTHONPATH=/work/wt-unit/results/dev-unit-tests:/tmp/devtrees/site
OPTS="-o addopts= -p no:cacheprovider -p no:warnings -rA"
MULTI="test_expert_grad_stats_tp_groups test_param_norm_expert_tp test_layer_wise_expert_grad_stats test_expert_linear_uses_expert_pgs"
i=0
while read c t; do
  i=$((i+1)); n=$(printf %02d $i)
  for side in before with; do
    tree=$D/bisect-tree; rm -rf $tree; mkdir -p $tree
    if [ $side = before ]; then rev=$c^; else rev=$c; fi
    git -C $F archive --format=tar $rev $PATHS | tar -x -C $tree
    mkdir -p $tree/$(dirname $t); git -C $F show $c:$t > $tree/$t
    cd $tree
    MASTER_PORT=29561 timeout 600 /work/main/.venv/bin/python -m pytest -p cpu_gloo_plugin $OPTS $t > $R/$n-$side-w1.log 2>&1
    echo "$n $side w1 rc=$? $(tail -1 $R/$n-$side-w1.log)"
    b=$(basename $t .py)
    if [[ " $MULTI " == *" $b "* ]]; then
      timeout 600 /work/main/.venv/bin/torchrun --nproc_per_node 2 --master_port 29563 --log-dir $R/$n-$side-w2-ranks --redirects 3 --tee 0 -m pytest -p cpu_gloo_plugin $OPTS $t > $R/$n-$side-w2.log 2>&1
      echo "$n $side w2 rc=$? $(tail -1 $(ls $R/$n-$side-w2-ranks/*/attempt_0/0/stdout.log))"
    fi
    cd $D
  done
done < $D/tests.txt
