"""Print, per case of tests/test_moe_oracle.py, what each tree gives against the oracle.

Run from the repository root (FORK_TEST_BASE selects the base, as for the test):
    .venv/bin/python results/moe-oracle-2026-12-05/oracle_table.py fork,pristine 2,4

One line per case: the candidates the change records say the tree lacks, then 'equal to the
oracle', the upstream error, or the parameter regions beyond their bound with the range of
got.ref / ref.ref per parameter kind (router.weight first in the README's tables).
"""

import collections
import os
import sys

sys.path.insert(0, os.getcwd())

import tests.test_moe_oracle as t  # noqa: E402  pylint: disable=wrong-import-position


def main(trees, worlds):
    for name in trees:
        tree = t.FORK if name == 'fork' else t.PRISTINE
        for world in worlds:
            for case in t._selected(tree, world):
                breaks = t._breaks(tree, case)
                kind, detail = t._compare(tree, case)
                ok = kind == 'grads' and not detail
                flag = 'as expected' if ok != bool(breaks) else 'UNEXPECTED'
                if kind == 'error':
                    summary = detail[:160]
                elif not detail:
                    summary = 'equal to the oracle'
                else:
                    ratios = collections.defaultdict(list)
                    for (key, _off), (_err, _bound, ratio) in detail.items():
                        short = '.'.join(key.split('.')[-2:])
                        ratios[('mtp:' if 'mtp' in key else '') + short].append(ratio)
                    ranges = {
                        k: (round(min(v), 4), round(max(v), 4))
                        for k, v in sorted(ratios.items())
                        if not isinstance(v[0], list)
                    }
                    summary = f'{len(detail)} regions beyond bound: {ranges}'
                print(f'{t.BASE} {tree} {case["name"]} [{flag}] breaks={breaks} -> {summary}')


if __name__ == '__main__':
    main(sys.argv[1].split(','), [int(w) for w in sys.argv[2].split(',')])
