# 10 runs of the warmup files after the MoE layouts and the restore changes (session 17), from a
# clone of HEAD (own trees), while a clean-clone CI run loads the machine.
rm -rf /tmp/ten2 && git clone -q /work/main /tmp/ten2 && cd /tmp/ten2 || exit 1
echo "clone $(git rev-parse --short HEAD) $(date)" > /tmp/ten2.summary
for i in $(seq 1 10); do
  t0=$(date +%s)
  FORK_TEST_BASE=0.19.2 /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_warmup.py tests/test_warmup_pp.py > /tmp/ten2-$i.log 2>&1
  rc=$?
  echo "run $i rc=$rc $(( $(date +%s) - t0 ))s load=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/ten2-$i.log)" >> /tmp/ten2.summary
done
echo "done $(date)" >> /tmp/ten2.summary
