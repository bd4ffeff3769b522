# 10 runs of the test files that the shrink touched (session 18): the warmup files, the DDP
# calibration file (new keep_golden_counts test) and the pretrain_gpt.py file (hook now run_warmup),
# from a clone of HEAD (own trees), while mutation runs and a clean-clone CI run load the machine.
rm -rf /tmp/ten3 && git clone -q /work/main /tmp/ten3 && cd /tmp/ten3 || exit 1
echo "clone $(git rev-parse --short HEAD) $(date)" > /tmp/ten3.summary
for i in $(seq 1 10); do
  t0=$(date +%s)
  FORK_TEST_BASE=0.19.2 /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_warmup.py tests/test_warmup_pp.py tests/test_ddp_calibration.py \
    tests/test_pretrain.py > /tmp/ten3-$i.log 2>&1
  rc=$?
  echo "run $i rc=$rc $(( $(date +%s) - t0 ))s load=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/ten3-$i.log)" >> /tmp/ten3.summary
done
echo "done $(date)" >> /tmp/ten3.summary
