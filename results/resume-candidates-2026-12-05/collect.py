"""Run the issue-30 resume scenarios on this base's pristine tree and write the raw per-rank
results as JSON (one file per base), for results/resume-candidates-2026-12-05/README.md.

    FORK_TEST_BASE=0.18.2 .venv/bin/python results/resume-candidates-2026-12-05/collect.py [names]

``names`` (optional): 'sched', 'w2', 'w4' (default: all three).
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests import test_resume_candidates as t  # noqa: E402
from tests.harness import run_world  # noqa: E402
from tests.harness.bases import BASE  # noqa: E402

RUNS = {
    'sched': (2, t.SCHED, t.SCHED_CASES),
    'w2': (2, t.ROUND, t.ROUND_W2),
    'w4': (4, t.ROUND, t.ROUND_W4),
}


def main(names):
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f'raw-{BASE}.json')
    out = json.load(open(out_path)) if os.path.exists(out_path) else {}
    for name in names:
        world, target, cases = RUNS[name]
        [per_rank] = run_world(world, t.PRISTINE, [(target, {'cases': cases})], timeout=900)
        out[name] = per_rank
        with open(out_path, 'w') as f:
            json.dump(out, f, indent=1, sort_keys=True)
        print(name, 'done', flush=True)


if __name__ == '__main__':
    main(sys.argv[1:] or list(RUNS))
