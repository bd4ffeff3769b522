"""The fork's own files are source files, once: edit one, `export` writes every base's patches.

Each test works in a copy of this checkout's tools/, patches/ and tracked source files (the files
the patches create, at their upstream paths), so the real series of every base is exercised.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from megatron_fork import sources  # noqa: E402  pylint: disable=C0413

SOURCE = "megatron/training/warmup.py"
RELEASES = ("0.19.2", "0.18.2")
DEV_REPO = os.environ.get("FORK_TEST_DEV_REPO")


def run(root, *args):
    """Run the copy's tools/fork.py and return the CompletedProcess."""
    return subprocess.run(
        [sys.executable, str(root / "tools" / "fork.py"), *args],
        cwd=root,
        capture_output=True,
        text=True,
    )


@pytest.fixture
def checkout(tmp_path):
    """tools/, patches/ and the source files of this checkout, without a materialized tree."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "patches", root / "patches")
    for path in sources.paths(REPO / "patches"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / path, root / path)
    return root


def creators_of(root, path):
    """The patch files (one per base) that create ``path``."""
    return [
        root / "patches" / base / entry for base, entry in sources.creators(root / "patches")[path]
    ]


def check_args():
    args = ["check", *(a for base in RELEASES for a in ("--base", base))]
    return args + ["--base", "dev", "--git-repo", DEV_REPO] if DEV_REPO else args


def test_every_file_a_patch_creates_is_a_tracked_source_with_the_same_bytes():
    """The checkout itself: 7 modules and the dev unit tests, each carried verbatim."""
    assert sources.drift(REPO, REPO / "patches") == []
    paths = sources.paths(REPO / "patches")
    assert SOURCE in paths and "megatron/training/state_snapshot.py" in paths
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--", *paths], capture_output=True, text=True
    ).stdout.split()
    if tracked or (REPO / ".git").exists():
        assert sorted(tracked) == paths


def test_editing_a_source_and_export_rewrite_all_three_series_and_check_passes(checkout):
    """The newcomer's path: edit megatron/training/warmup.py as a file, run one command."""
    patches = creators_of(checkout, SOURCE)
    assert {p.parent.parent.name for p in patches} == {"dev", *RELEASES}
    before = {p: p.read_text() for p in patches}
    text = (checkout / SOURCE).read_text()
    # Lines added and one changed: the hunk header and the diffstat change with them.
    edited = text.replace("import contextlib\n", "import contextlib\n# one\n# two\n", 1)
    (checkout / SOURCE).write_text(edited.replace("then an exact", "then an exactly", 1))

    proc = run(checkout, "export")
    assert proc.returncode == 0, proc.stderr
    for patch in patches:
        base, entry = patch.parent.parent.name, f"{patch.parent.name}/{patch.name}"
        assert f"wrote {base}/{entry}" in proc.stdout
        after = patch.read_text()
        assert after != before[patch]
        assert sources.created(after)[SOURCE] == (checkout / SOURCE).read_text()
        # Nothing else in the patch moved: the other files it creates are byte-identical.
        old, new = sources.created(before[patch]), sources.created(after)
        assert {k: v for k, v in old.items() if k != SOURCE} == {
            k: v for k, v in new.items() if k != SOURCE
        }
    proc = run(checkout, *check_args())
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count(": OK") == len(RELEASES) + bool(DEV_REPO)
    assert run(checkout, "export").stdout.strip() == "patches/ is up to date (no byte changed)"


def test_check_names_a_patch_that_carries_other_bytes_than_the_source(checkout):
    """A patch edited by hand (or a source edited without export) fails check, one line each."""
    patch = next(p for p in creators_of(checkout, SOURCE) if p.parent.parent.name == "0.18.2")
    patch.write_text(patch.read_text().replace("+import contextlib\n", "+import  contextlib\n", 1))
    proc = run(checkout, "check", "--base", "0.18.2")
    assert proc.returncode == 1
    lines = [l for l in proc.stderr.splitlines() if SOURCE in l]
    assert len(lines) == 1 and "patches/0.18.2/" in lines[0] and "tools/fork.py export" in lines[0]


def test_materialize_keeps_an_edited_source_and_export_folds_it_into_the_queue(checkout):
    """--force discards the queue's unexported work, never the fork's source files."""
    assert run(checkout, "materialize", "--base", "0.18.2").returncode == 0
    assert (checkout / "megatron/core/optimizer/expert_grad_stats.py").is_file()
    edited = (checkout / SOURCE).read_text() + "# edited\n"
    (checkout / SOURCE).write_text(edited)
    proc = run(checkout, "materialize", "--base", "0.18.2")
    assert proc.returncode == 6 and SOURCE in proc.stderr
    assert run(checkout, "materialize", "--base", "0.19.2", "--force").returncode == 0
    assert (checkout / SOURCE).read_text() == edited
    # 0.19.2 does not carry this source (its upstream has the change); it stays in the tree.
    assert (checkout / "megatron/core/optimizer/expert_grad_stats.py").is_file()
    proc = run(checkout, "export")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("wrote ") == 3
    proc = run(checkout, "materialize", "--base", "0.19.2")
    assert proc.returncode == 0, proc.stderr  # nothing unexported is left
    proc = run(checkout, "check", "--base", "0.19.2", "--base", "0.18.2")
    assert proc.returncode == 0, proc.stderr


def test_check_names_a_created_file_that_is_not_tracked_as_a_source(checkout):
    """A patch that creates a file the checkout does not hold fails check, naming both."""
    (checkout / SOURCE).unlink()
    proc = run(checkout, "check", "--base", "0.18.2")
    assert proc.returncode == 1
    lines = [l for l in proc.stderr.splitlines() if SOURCE in l]
    assert len(lines) == 1 and "patches/0.18.2/" in lines[0] and "not tracked" in lines[0]
