"""The README's main job: the fork's scenarios on pristine upstream and on the fork, as a table.

Runs on CPU ranks with gloo (world size 2) by default, or with NCCL when ``FORK_TEST_BACKEND=nccl``
(``tools/demo.sh`` sets it when GPUs are present; the world size is then the GPU count, at most 2).
Exit status 0 when every row shows the expected outcome on both arms.
"""

import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.launcher import run_world  # noqa: E402  pylint: disable=wrong-import-position

WARMUP = "tests.scenarios.warmup:scenario_end_to_end"
OVERCOUNT = "tests.scenarios.ddp_calibration:scenario_overcount"
ORACLE = "tests.scenarios.expert_grad_stats:scenario_exact_oracle"


def world_size():
    """2 CPU ranks, or as many GPUs as are visible (at most 2) under NCCL."""
    if os.environ.get("FORK_TEST_BACKEND") == "nccl":
        import torch  # pylint: disable=import-outside-toplevel

        return max(1, min(2, torch.cuda.device_count()))
    return 2


def short(result):
    """One cell of the table: the outcome of rank 0."""
    if "error" in result:
        return "harness error: " + result["error"][:70]
    if result.get("step_error") or result.get("raised"):
        text = result.get("step_error") or result.get("raised")
        return "DIES: " + text.split("\n")[0][:120]
    if "losses" in result:
        return "trains, losses " + ", ".join(f"{x:.4f}" for x in result["losses"])
    if "zeros" in result:
        return f"norm {result['norm']:.4f}, zeros {result['zeros']}"
    if "norm" in result:
        calib = result["calibration_norm"]
        return f"trains, grad norm {result['norm']:.4f} (calibration step {calib:.4f})"
    return str(result)[:90]


def main():
    """Run both arms and print the table."""
    world = world_size()
    start = time.time()
    warm = [
        (WARMUP, {"arm": "naive", "accumulation": 1, "finalize": False}),
        (WARMUP, {"arm": "naive", "accumulation": 2, "finalize": True}),
        (WARMUP, {"arm": "naive", "accumulation": 4, "finalize": True}),
    ]
    fork_warm = [(t, {**kw, "arm": "fork"}) for t, kw in warm]
    common = [(OVERCOUNT, {"later_no_sync": False}), (ORACLE, {"use_distributed_optimizer": True})]
    pristine = run_world(world, "pristine-0.18.2", warm + common)
    fork = run_world(world, "fork", fork_warm + common)
    upstream_019 = run_world(world, "pristine-0.19.2", [common[1]])
    rows = [
        ("warmup without finalize_model_grads, accumulation 1", 0),
        ("warmup without no_sync_func, accumulation 2", 1),
        ("warmup without no_sync_func, accumulation 4", 2),
        ("grad-ready over-count (calibrated 1, later no no_sync)", 3),
        (f"expert grad norm / zero count, TP=EP={world}, ETP=1, distopt", 4),
    ]
    ok = True
    print(
        f"\nworld size {world}, backend {os.environ.get('FORK_TEST_BACKEND', 'gloo')}, "
        f"{time.time() - start:.0f} s\n"
    )
    print("| scenario | pristine megatron-core 0.18.2 | fork 0.18.2+fork |")
    print("|---|---|---|")
    for label, index in rows:
        p, f = pristine[index][0], fork[index][0]
        print(f"| {label} | {short(p)} | {short(f)} |")
        if index < 3:
            ok &= bool(p.get("step_error")) and not f.get("step_error") and "error" not in f
        elif index == 3:
            ok &= not p.get("raised") and bool(f.get("raised"))
        elif world > 1:
            ok &= math.isclose(f["norm"], math.sqrt(1 + world), rel_tol=1e-6)
            ok &= math.isclose(p["norm"], math.sqrt(2), rel_tol=1e-6)
    u = upstream_019[0][0]
    print(f"| (reference) upstream 0.19.2, expert grad stats | {short(u)} | |")
    print(
        "\nexpected: pristine dies or is silently wrong; the fork trains, or fails loudly where "
        "upstream trains on wrong gradients; expert norm sqrt(1+world) = "
        f"{math.sqrt(1 + world):.4f} and zeros {1 + world} on the fork (and on 0.19.2)."
    )
    print("demo: OK" if ok else "demo: UNEXPECTED OUTCOME")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
