"""The README's cherry-pick route holds: each base's series applies with plain `git am`, in
series order, on the Megatron-LM ref the README names for it.

The README names `patches/<base>/` for a ref per base; the ref is the base's upstream ref
(tests.harness.bases.upstream_ref: the pinned dev commit, the `core_r0.19.0` branch, the
`core_v0.18.2` tag). The check needs a Megatron-LM clone that has those refs: ``FORK_MEGATRON_LM``
(tier megatron-lm), or ``FORK_TEST_DEV_REPO`` (tier dev) for the dev base alone. Each run works
in a temporary work tree of that clone (``git worktree``) and removes it.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import bases, tiers

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MEGATRON_LM = os.environ.get("FORK_MEGATRON_LM") or None
DEV_REPO = os.environ.get("FORK_TEST_DEV_REPO") or None


def test_the_readme_names_every_maintained_base_with_its_ref():
    """`patches/<base>/` for its upstream ref: the route the test below checks."""
    text = " ".join(README.split())
    for base in bases.PIN["maintained"]:
        ref = bases.upstream_ref(base)
        words = "at the pinned commit" if base == "dev" else f"`{ref}`"
        assert re.search(rf"`patches/{re.escape(base)}/` for [^,]*{re.escape(words)}", text), base
    assert "git am -3" not in text.replace("even with `git am -3`", "")


def _resolve(clone, ref):
    for rev in (ref, f"origin/{ref}", f"refs/tags/{ref}"):
        proc = subprocess.run(
            ["git", "-C", clone, "rev-parse", "-q", "--verify", f"{rev}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if proc.returncode == 0:
            return proc.stdout.strip()
    pytest.fail(f"{clone} has no {ref}: fetch it there (git fetch origin {ref})")


def _apply_series(clone, base, tmp_path):
    """`git am` each patch of the base's series in order on a work tree at the base's ref;
    returns the patches that did not apply."""
    commit = _resolve(clone, bases.upstream_ref(base))
    work = tmp_path / f"route-{base}"
    subprocess.run(
        ["git", "-C", clone, "worktree", "add", "-q", "--detach", str(work), commit], check=True
    )
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    failed = []
    try:
        for entry in (REPO / "patches" / base / "series").read_text().split():
            proc = subprocess.run([*git, "am", "-q", str(REPO / "patches" / base / entry)],
                                  capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                failed.append(entry)
                subprocess.run([*git, "am", "--abort"], capture_output=True)
    finally:
        subprocess.run(["git", "-C", clone, "worktree", "remove", "--force", str(work)])
    return failed


@tiers.skipif(not MEGATRON_LM, "megatron-lm", "FORK_MEGATRON_LM is not set")
@pytest.mark.parametrize("base", bases.PIN["maintained"])
def test_each_series_applies_with_plain_git_am_on_its_ref(base, tmp_path):
    assert _apply_series(MEGATRON_LM, base, tmp_path) == []


@tiers.skipif(not DEV_REPO, "dev", "FORK_TEST_DEV_REPO is not set")
def test_the_dev_series_applies_with_plain_git_am_on_the_pinned_commit(tmp_path):
    assert _apply_series(DEV_REPO, "dev", tmp_path) == []
