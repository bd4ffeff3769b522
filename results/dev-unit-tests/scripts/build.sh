#!/bin/bash
# Recorded as run on 2026-12-03 (paths of that session: /tmp/devtrees2, /work/wt-unit); see ../README.md.
# Build test trees from the git-am'd full checkout: pristine, fork, and per-patch before/with.
set -e
D=/tmp/devtrees2; F=$D/full
PATHS="megatron tests/__init__.py tests/unit_tests tests/test_utils pyproject.toml"
arch() { rm -rf $2; mkdir -p $2; git -C $F archive --format=tar $1 $PATHS | tar -x -C $2; }
arch HEAD $D/fork
arch d48bd6be $D/pristine
for c in $(git -C $F rev-list --reverse d48bd6be..HEAD); do
  t=$(git -C $F show --format= --name-only --diff-filter=A $c -- tests/unit_tests)
  mkdir -p $D/pristine/$(dirname $t); git -C $F show $c:$t > $D/pristine/$t
  n=$(git -C $F log -1 --format=%s $c | md5sum | cut -c1-6)
  echo "$c $t" >> $D/tests.txt
done
