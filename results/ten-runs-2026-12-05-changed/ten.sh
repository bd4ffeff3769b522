#!/usr/bin/env bash
# Ten loaded runs of the tests added or changed after the first ten-run loop (b787407).
cd "$(git rev-parse --show-toplevel)"
for i in $(seq 1 10); do
  t0=$(date +%s)
  FORK_TEST_BASE=0.19.2 .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_warmup.py tests/test_warmup_observed.py tests/test_train_loop_hooks.py \
    tests/test_dockerfile.py tests/test_first_five_table.py tests/test_sources.py \
    tests/test_clean_builds.py::test_metadata_commands_do_not_materialize \
    tests/test_fork_tool.py::test_a_new_patch_is_named_by_its_fork_change_slug_uncut \
    tests/test_fork_tool.py::test_a_patch_message_over_40_lines_fails_check \
    tests/test_fork_tool.py::test_base_and_series_answer_the_scripts \
    tests/test_fork_tool.py::test_interrupted_apply_leaves_previous_tree \
    tests/test_fork_tool.py::test_sigint_and_sigterm_leave_the_tree_and_no_temporary_folder \
    tests/test_fork_tool.py::test_rebase_carries_the_series_and_prints_range_diff \
    > /tmp/ten2-run$i.log 2>&1
  echo "run $i rc $? $(( $(date +%s) - t0 )) s load $(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/ten2-run$i.log)" >> /tmp/ten2-summary.txt
done
