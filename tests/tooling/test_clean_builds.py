"""Builds of two bases in sequence: each wheel holds exactly its base's files.

setuptools reuses its build directory between builds and never removes a file from it, so a
0.19.2 build after a 0.18.2 build once shipped 0.18.2's extra modules (and the other way round).
The test copies the checkout, builds the 0.18.2 wheel, then the 0.19.2 wheel, then 0.18.2 again
in the same copy, and compares each wheel's ``megatron/`` with the pinned upstream wheel's plus
the files its series adds. The same wheels are checked for the licence: LICENSE and NOTICE in
``.dist-info/licenses/``, byte for byte, and METADATA giving LICENSE's terms as one SPDX expression
(upstream's wheels say ``License: Apache 2.0``).
"""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from megatron_fork import series, sources, upstream  # noqa: E402  pylint: disable=C0413
from megatron_fork.workspace import Workspace  # noqa: E402  pylint: disable=C0413

WS = Workspace(REPO)
PIN = upstream.load_pin(WS.pin_file)
RELEASES = upstream.releases(PIN)


def _megatron_files(wheel):
    with zipfile.ZipFile(wheel) as zf:
        return {n for n in zf.namelist() if n.startswith("megatron/") and not n.endswith("/")}


def _added_by_series(base):
    """The files that ``patches/<base>/series`` creates or deletes."""
    added, deleted = set(), set()
    for patch in series.load_series(WS.patch_dir(base)):
        text = patch.path.read_text()
        for path, mode in re.findall(
            r"^diff --git a/\S+ b/(\S+)\n(new|deleted) file mode", text, re.M
        ):
            (added if mode == "new" else deleted).add(path)
    return {p for p in added if p.startswith("megatron/")}, deleted


def _copy(dest):
    """Copy the checkout's tracked and untracked (not ignored) files to ``dest``."""
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the checkout's tracked and untracked (not ignored) files."""
    return _copy(tmp_path_factory.mktemp("clean-builds") / "repo")


def test_metadata_commands_do_not_materialize(tmp_path):
    """``setup.py --version`` and ``egg_info`` read the series; only a build makes megatron/."""
    repo = _copy(tmp_path / "repo")
    for cmd in (["--version"], ["-q", "egg_info", "--egg-base", str(tmp_path)]):
        proc = subprocess.run(
            [sys.executable, "setup.py", *cmd], cwd=repo, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        # A clone's megatron/ holds the fork's source files only; nothing was materialized.
        tree = {p.relative_to(repo).as_posix() for p in repo.glob("megatron/**/*") if p.is_file()}
        assert tree <= set(sources.paths(repo / "patches")), cmd
        assert not (repo / ".pq").exists(), cmd
    version = subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=repo, capture_output=True, text=True
    ).stdout.split()[-1]
    assert re.fullmatch(rf"{re.escape(PIN['default'])}\+fork\.\d+\.g[0-9a-f]{{8}}", version)


def _build(checkout, base, out):
    for cmd in (
        [sys.executable, "tools/fork.py", "materialize", "--base", base],
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(out), "."],
    ):  # fmt: skip
        proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    [wheel] = out.glob("megatron_core-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(checkout, tmp_path_factory):
    """[(base, wheel)]: the older release, the newer, the older again, built in that order in one
    copy of the checkout (the slow part of this module: every test here reads these wheels)."""
    if len(RELEASES) < 2:
        pytest.fail(f"needs two maintained releases, {PIN['maintained']} has {RELEASES}")
    out = tmp_path_factory.mktemp("clean-builds-wheels")
    order = [RELEASES[1], RELEASES[0], RELEASES[1]]  # older, newer, older again
    return [(base, _build(checkout, base, out / f"out{i}")) for i, base in enumerate(order)]


def test_each_wheel_holds_exactly_its_bases_files(wheels):
    order = [base for base, _ in wheels]
    for i, (base, wheel) in enumerate(wheels):
        pristine = upstream.fetch_wheel(PIN, base)
        added, deleted = _added_by_series(base)
        expected = (_megatron_files(pristine) - deleted) | added
        got = _megatron_files(wheel)
        assert got == expected, (
            f"build {i} ({base}, after {order[:i]}): "
            f"extra {sorted(got - expected)[:8]}, missing {sorted(expected - got)[:8]}"
        )


def test_each_wheel_ships_the_licence_and_says_bsd_3_clause(wheels):
    """LICENSE and NOTICE in ``.dist-info/licenses/`` byte for byte; METADATA's licence fields
    are the SPDX expression of LICENSE's terms (BSD-3-Clause, then the Apache-2.0 and MIT code it
    names), with no bare ``License:`` line or licence classifier (upstream's wheels say
    ``License: Apache 2.0`` next to the classifier ``BSD License``)."""
    expected = {name: (REPO / name).read_bytes() for name in ("LICENSE", "NOTICE")}
    for base, wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            [info] = {n.split("/", 1)[0] for n in zf.namelist() if ".dist-info/" in n}
            shipped = {
                n.removeprefix(f"{info}/licenses/"): zf.read(n)
                for n in zf.namelist()
                if n.startswith(f"{info}/licenses/")
            }
            metadata = zf.read(f"{info}/METADATA").decode()
        assert shipped == expected, (base, wheel.name, sorted(shipped))
        head = metadata.split("\n\n", 1)[0]  # the header fields, not the README after them
        fields = re.findall(r"^(License[\w-]*|Classifier): (.*)$", head, re.M)
        assert ("License-Expression", "BSD-3-Clause AND Apache-2.0 AND MIT") in fields, fields
        assert sorted(v for k, v in fields if k == "License-File") == ["LICENSE", "NOTICE"]
        # No bare `License:` (superseded by the expression), no licence classifier.
        assert not [f for f in fields if f[0] == "License" or "License ::" in f[1]], fields
