"""LICENSE is Megatron-LM's own LICENSE, byte for byte, at every maintained base; NOTICE says what
the fork adds and under which terms.

patches/upstream.toml records per maintained base the sha256 of upstream's LICENSE at the base's
ref (``license_sha256``). The committed LICENSE must match the record of every maintained base.
Where a Megatron-LM clone is given, it is also compared with the clone's LICENSE at each base's
ref: ``FORK_MEGATRON_LM`` (tier megatron-lm) at every base's ref, ``FORK_TEST_DEV_REPO`` (tier
dev: a clone that has the pinned dev commit) at the git bases' commits.
"""

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import bases, tiers

REPO = Path(__file__).resolve().parents[2]
LICENSE = REPO / "LICENSE"
NOTICE = REPO / "NOTICE"
PIN = bases.PIN
MAINTAINED = PIN["maintained"]
GIT_BASES = [b for b in MAINTAINED if "commit" in PIN["bases"][b]]
MEGATRON_LM = os.environ.get("FORK_MEGATRON_LM") or None
DEV_REPO = os.environ.get("FORK_TEST_DEV_REPO") or None


def sha256(data):
    """Hex sha256 of ``data`` (bytes)."""
    return hashlib.sha256(data).hexdigest()


def license_at(clone, ref):
    """Bytes of LICENSE at ``ref`` in the Megatron-LM clone ``clone`` (a work tree's clone may
    have a branch as ``origin/<ref>`` only); fails naming the clone and the ref."""
    errors = []
    for rev in (ref, f"origin/{ref}"):
        proc = subprocess.run(["git", "-C", clone, "show", f"{rev}:LICENSE"], capture_output=True)
        if proc.returncode == 0:
            return proc.stdout
        errors.append(proc.stderr.decode(errors="replace").strip())
    pytest.fail(f"{clone} has no LICENSE at {ref}: fetch that ref there ({errors[0]})")


@pytest.mark.parametrize("base", MAINTAINED)
def test_license_matches_the_recorded_hash_of_every_maintained_base(base):
    recorded = PIN["bases"][base].get("license_sha256")
    assert recorded, f"patches/upstream.toml: base {base!r} records no license_sha256"
    assert re.fullmatch(r"[0-9a-f]{64}", recorded), recorded
    assert sha256(LICENSE.read_bytes()) == recorded, (
        f"LICENSE is not upstream's LICENSE of base {base} (sha256 {recorded}): copy it byte "
        f"for byte from Megatron-LM at {bases.upstream_ref(base)}, or review LICENSE and NOTICE "
        "for a base whose LICENSE changed"
    )


def test_license_is_upstreams_bsd_text_with_its_third_party_notices():
    """A sanity check of what the hash pins: NVIDIA's BSD-3-Clause terms first, then the notices
    of the third-party code upstream includes."""
    text = LICENSE.read_text()
    assert text.startswith("The following applies to all files unless otherwise noted:\n")
    assert "NVIDIA CORPORATION. All rights reserved." in text.splitlines()[2]
    assert "Neither the name of NVIDIA CORPORATION" in text
    assert "This repository also contains code from" in text


def _check_clone(clone, base):
    got = license_at(clone, bases.upstream_ref(base))
    assert sha256(got) == PIN["bases"][base]["license_sha256"], (
        f"{clone} at {bases.upstream_ref(base)}: LICENSE sha256 {sha256(got)} differs from "
        f"the record of base {base} in patches/upstream.toml"
    )
    assert got == LICENSE.read_bytes()


@tiers.skipif(not MEGATRON_LM, "megatron-lm", "FORK_MEGATRON_LM is not set")
@pytest.mark.parametrize("base", MAINTAINED)
def test_license_matches_the_megatron_lm_clone_at_each_base(base):
    _check_clone(MEGATRON_LM, base)


@tiers.skipif(not DEV_REPO, "dev", "FORK_TEST_DEV_REPO is not set")
@pytest.mark.parametrize("base", GIT_BASES)
def test_license_matches_the_dev_clone_at_each_git_base(base):
    _check_clone(DEV_REPO, base)


def test_notice_names_the_fork_terms_and_every_top_level_entry():
    """NOTICE states the fork's terms, and says for every top-level entry of the repository
    (a directory or file) whose terms it is, so a new one cannot go unmentioned."""
    text = NOTICE.read_text()
    assert "BSD-3-Clause" in text and "Copyright (c) " in text and "fork authors" in text
    assert "LICENSE" in text and "byte for byte" in text
    assert "Neither the name of the copyright holder nor the names of its contributors" in text
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.split()
    top = {p.split("/", 1)[0] + ("/" if "/" in p else "") for p in tracked}
    unnamed = [
        name
        for name in sorted(top - {"LICENSE", "NOTICE"})
        if not (name.startswith(".") and not name.endswith("/"))  # "the top-level dotfiles"
        and not re.search(rf"(?<![\w./-]){re.escape(name.rstrip('/'))}\b", text)
    ]
    assert not unnamed, f"NOTICE does not say under which terms these are: {unnamed}"
    for path in re.findall(r"(?<![\w.])((?:patches|tests|tools)/[\w./-]*\w)", text):
        assert (REPO / path).exists(), f"NOTICE names {path}, which does not exist"
