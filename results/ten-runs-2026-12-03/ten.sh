# 10 runs each of the calibration, warmup and expert files, from a clone of HEAD (own trees).
rm -rf /tmp/ten && git clone -q /work/main /tmp/ten && cd /tmp/ten || exit 1
echo "clone $(git rev-parse --short HEAD) $(date)" > /tmp/ten.summary
for i in $(seq 1 10); do
  t0=$(date +%s)
  FORK_TEST_BASE=0.19.2 /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_ddp_calibration.py tests/test_warmup.py tests/test_warmup_pp.py tests/test_expert_grad_stats.py > /tmp/ten-$i.log 2>&1
  rc=$?
  echo "run $i rc=$rc $(( $(date +%s) - t0 ))s load=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/ten-$i.log)" >> /tmp/ten.summary
done
echo "done $(date)" >> /tmp/ten.summary
