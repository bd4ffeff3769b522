#!/bin/bash
# Recorded as run on 2026-12-03 (paths of that session: /tmp/devtrees2, /work/wt-unit); see ../README.md.
# Turn the run logs into committed summaries (outcome lines + failure lines) and gzipped full logs.
D=/work/wt-unit/results/dev-unit-tests/logs; R=/tmp/devtrees2/results
mkdir -p $D/full
summ() {  # name source
  gzip -9c $2 > $D/full/$1.log.gz
  { grep -m3 -E "^platform|^rootdir|fork cpu_gloo_plugin" $2; echo; echo "# failure lines (E ...)"
    grep -E "^E +" $2 | grep -vE "^E +$" | cut -c1-220; echo; echo "# outcomes"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED) " $2 | grep -v download_unit_tests_dataset; tail -1 $2; } > $D/$1.txt
}
rm -f $D/cpu-*.txt $D/full/cpu-*.log.gz
for t in pristine fork; do
  summ cpu-native-w1-$t $R/cpu-native-$t.log
  summ cpu-gloo-w1-$t $R/cpu-gloo-w1-$t.log
  for w in 2 4; do for r in $(seq 0 $((w-1))); do
    summ cpu-gloo-w$w-$t-rank$r $(ls $R/w$w-$t/*/attempt_0/$r/stdout.log)
  done; done
done
cp /tmp/devtrees2/git-am.log $D/git-am-d48bd6be.log
cp /tmp/devtrees2/tests.txt $D/am-commits-and-tests.txt
cp /tmp/devtrees2/bisect.out $D/cpu-bisect-summary.txt
sed -i '/^done$/d' $D/cpu-bisect-summary.txt
cd $R/bisect && { for f in $(ls *-before-w1.log *-before-w2.log | sort); do echo "## $f"; src=$f
  if [[ $f == *w2.log ]]; then src=$(ls ${f%.log}-ranks/*/attempt_0/0/stdout.log); echo "(rank 0)"; fi
  grep -E "^E +" $src | grep -vE "^E +$" | grep -vE "Expected|Obtained|comparison failed|^E +\+" | cut -c1-200 | sort | uniq -c | sort -rn | head -6
  grep -E "^(FAILED|ERROR) " $src | grep -v download_unit_tests_dataset | cut -c1-200; done; } > $D/cpu-bisect-before-failures.txt
cp /tmp/devtrees2/build.sh /tmp/devtrees2/runall.sh /tmp/devtrees2/bisect.sh /tmp/devtrees2/collect.sh /work/wt-unit/results/dev-unit-tests/scripts/
for f in /work/wt-unit/results/dev-unit-tests/scripts/{build,runall,bisect,collect}.sh; do
  grep -q "^# Recorded as run" $f || sed -i '1a # Recorded as run on 2026-12-03 (paths of that session: /tmp/devtrees2, /work/wt-unit); see ../README.md.' $f
done
