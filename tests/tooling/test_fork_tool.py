"""Tests of tools/fork.py: bad input gives a clear error and loses nothing.

Each test works in a sandbox copy of tools/ and patches/upstream.toml whose only maintained base
is 0.18.2 (series in patches/0.18.2/), with the real pinned megatron-core 0.18.2 wheel from the
shared cache (fetched once per session).
"""

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.harness import tiers

REPO = Path(__file__).resolve().parents[2]
TARGET = "megatron/core/distributed/distributed_data_parallel_config.py"
BASE = "0.18.2"


def series_dir(sandbox):
    """The sandbox's series directory (patches/0.18.2)."""
    return sandbox / "patches" / BASE


def run(sandbox, *args, env=None):
    """Run the sandbox's tools/fork.py and return the CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, str(sandbox / "tools" / "fork.py"), *args],
        cwd=sandbox,
        capture_output=True,
        text=True,
        env=full_env,
    )


@pytest.fixture(scope="session")
def pinned_wheel():
    """The hash-verified 0.18.2 wheel in the cache (downloads it once if needed)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "fork.py"), "fetch", "--base", BASE],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.split()[0])


@pytest.fixture
def sandbox(tmp_path, pinned_wheel):
    """A copy of the tooling with an empty series, materialized once."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "patches" / BASE).mkdir(parents=True)
    pin = (REPO / "patches" / "upstream.toml").read_text()
    pin = re.sub(r'(?m)^primary = .*$', f'primary = "{BASE}"', pin)
    pin = re.sub(r'(?m)^default = .*$', f'default = "{BASE}"', pin)
    pin = re.sub(r'(?m)^maintained = .*$', f'maintained = ["{BASE}"]', pin)
    (root / "patches" / "upstream.toml").write_text(pin)
    (series_dir(root) / "series").write_text("")
    proc = run(root, "materialize")
    assert proc.returncode == 0, proc.stderr
    return root


def work_repo(sandbox, dirname, files=(TARGET,)):
    """A scratch git repo holding the pristine ``files``, committed as 'base'.

    Returns:
        (work directory, the git command prefix for it).
    """
    work = sandbox.parent / dirname
    shutil.rmtree(work, ignore_errors=True)
    for rel in files:
        (work / Path(rel).parent).mkdir(parents=True, exist_ok=True)
        shutil.copy(sandbox / rel, work / rel)
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    return work, git


def format_patch(git):
    """The last commit of a work repo as a format-patch text."""
    return subprocess.run(
        [*git, "format-patch", "--full-index", "--zero-commit", "--no-signature", "-1", "--stdout"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def make_patch(sandbox, name, old, new, subject="test: change a default"):
    """Write a format-patch file that replaces ``old`` by ``new`` in TARGET of the pristine tree."""
    work, git = work_repo(sandbox, f"work-{name}")
    text = (work / TARGET).read_text()
    assert old in text
    (work / TARGET).write_text(text.replace(old, new, 1))
    subprocess.run([*git, "commit", "-qam", f"{subject}\n\nBody.\n\nForwarded: no"], check=True)
    out = format_patch(git)
    (series_dir(sandbox) / name).write_text(out)
    return out


def flip_overlap(sandbox, name):
    """make_patch of the one-line patch most tests use: overlap_grad_reduce defaults to True."""
    return make_patch(
        sandbox, name, "overlap_grad_reduce: bool = False", "overlap_grad_reduce: bool = True"
    )


def add_to_series(sandbox, *names):
    with open(series_dir(sandbox) / "series", "a") as f:
        f.write("".join(f"{n}\n" for n in names))


def tree_digest(sandbox):
    digest = hashlib.sha256()
    for path in sorted((sandbox / "megatron").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def test_clean_patch_applies_exports_idempotently_and_check_passes(sandbox):
    original = flip_overlap(sandbox, "0001-a.patch")
    add_to_series(sandbox, "0001-a.patch")
    assert run(sandbox, "materialize").returncode == 0
    assert "overlap_grad_reduce: bool = True" in (sandbox / TARGET).read_text()
    # First export normalizes the hand-made patch; a second one changes no byte.
    assert run(sandbox, "export").returncode == 0
    exported = sorted(series_dir(sandbox).glob("*.patch"))
    assert [p.name for p in exported] == ["0001-a.patch"]
    first = exported[0].read_bytes()
    assert (
        b"overlap_grad_reduce: bool = True" in first and original.splitlines()[3] in first.decode()
    )
    proc = run(sandbox, "export")
    assert proc.returncode == 0 and "no byte changed" in proc.stdout
    assert exported[0].read_bytes() == first
    proc = run(sandbox, "check")
    assert proc.returncode == 0, proc.stderr


def test_edit_commit_export_roundtrip_and_unexported_work_is_protected(sandbox):
    flip_overlap(sandbox, "0001-a.patch")
    add_to_series(sandbox, "0001-a.patch")
    assert run(sandbox, "materialize").returncode == 0
    target = sandbox / TARGET
    target.write_text(target.read_text() + "# extra line\n")
    proc = run(sandbox, "materialize")
    assert proc.returncode == 6 and "would be lost" in proc.stderr
    assert target.read_text().endswith("# extra line\n")
    assert run(sandbox, "commit", "--to", "0001-a.patch").returncode == 0
    assert run(sandbox, "export").returncode == 0
    assert "+# extra line" in (series_dir(sandbox) / "0001-a.patch").read_text()
    assert run(sandbox, "check").returncode == 0


def test_materialize_names_upstream_files_in_the_clone_exclude_only(sandbox):
    """In a git clone, materialize lists upstream's files in info/exclude (its block replaced,
    the user's own rules kept): git status shows a new file in megatron/ and hides the rest."""
    git = ["git", "-C", str(sandbox)]
    subprocess.run([*git, "init", "-q"], check=True)
    exclude = sandbox / ".git" / "info" / "exclude"
    exclude.write_text("my-own-rule\n")
    for _ in range(2):  # a second materialize replaces the block, never appends another
        assert run(sandbox, "materialize", "--force").returncode == 0
    text = exclude.read_text()
    assert text.startswith("my-own-rule\n") and text.count("tools/fork.py materialize:") == 1
    new = sandbox / "megatron" / "core" / "a_new_source.py"
    new.write_text("X = 1\n")
    status = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=all", "--", "megatron"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert status == "?? megatron/core/a_new_source.py\n"
    ignored = subprocess.run([*git, "check-ignore", "-q", TARGET], check=False)
    assert ignored.returncode == 0


def test_a_new_patch_is_named_by_its_fork_change_slug_uncut(sandbox, tmp_path):
    """One name per change: ``commit --new`` + export name the file NNNN-<Fork-Change>.patch,
    the next number after the series, and never cut a long name."""
    slug = "ddp-overlap-grad-reduce-on-by-default-for-every-model-in-this-test"
    target = sandbox / TARGET
    target.write_text(target.read_text() + "# a change\n")
    message = tmp_path / "message.txt"
    message.write_text(f"Body.\n\nForwarded: no\nFork-Change: {slug}\n")
    subject = "ddp: a subject long enough that a name cut at 52 characters loses its end"
    proc = run(sandbox, "commit", "--new", subject, "--message-file", str(message))
    assert proc.returncode == 0, proc.stderr
    assert run(sandbox, "export").returncode == 0
    assert (series_dir(sandbox) / "series").read_text() == f"fork/0001-{slug}.patch\n"
    assert (series_dir(sandbox) / "fork" / f"0001-{slug}.patch").is_file()


def test_a_new_patch_takes_its_change_records_number(sandbox, tmp_path):
    """A change recorded in changes.toml keeps its number on every base: ``commit --new`` of the
    change on a base whose series ends lower (or where another base already took numbers past
    it) names the file by the record's number, not the next free one."""
    slug = "warmup-numbered-by-its-record"
    (sandbox / "patches" / "changes.toml").write_text(
        f"[changes.{slug}]\nnumber = 57\ngroup = \"fork\"\nsubject = \"ddp: numbered\"\n"
        'summary = "s"\nfamily = "warmup"\nforwarded = "no"\ntests = []\n'
        f'bases = {{ "{BASE}" = "carried" }}\n'
    )
    target = sandbox / TARGET
    target.write_text(target.read_text() + "# a change\n")
    message = tmp_path / "message.txt"
    message.write_text(f"Body.\n\nFork-Change: {slug}\n")
    proc = run(sandbox, "commit", "--new", "ddp: numbered", "--message-file", str(message))
    assert proc.returncode == 0, proc.stderr
    proc = run(sandbox, "export")
    assert proc.returncode == 0, proc.stderr
    assert (series_dir(sandbox) / "series").read_text() == f"fork/0057-{slug}.patch\n"


def test_corrupt_patch_is_refused_and_tree_untouched(sandbox):
    before = tree_digest(sandbox)
    (series_dir(sandbox) / "0001-bad.patch").write_text("this is not a patch\n")
    add_to_series(sandbox, "0001-bad.patch")
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5
    assert "0001-bad.patch" in proc.stderr and "not a git format-patch" in proc.stderr
    assert tree_digest(sandbox) == before


def test_truncated_patch_is_refused(sandbox):
    text = flip_overlap(sandbox, "0001-a.patch")
    (series_dir(sandbox) / "0001-a.patch").write_text(text[: text.rindex("@@") + 40])
    add_to_series(sandbox, "0001-a.patch")
    before = tree_digest(sandbox)
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5 and "0001-a.patch" in proc.stderr and "truncated" in proc.stderr
    assert tree_digest(sandbox) == before


def _shift_hunk(text, delta):
    return re.sub(
        r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@",
        lambda m: f"@@ -{int(m[1]) + delta},{m[2]} +{int(m[3]) + delta},{m[4]} @@",
        text,
        flags=re.M,
    )


def test_patch_needing_fuzz_or_offset_is_refused_naming_patch_file_and_hunk(sandbox):
    text = flip_overlap(sandbox, "0001-a.patch")
    # Offset: the hunk claims a position 7 lines off.
    (series_dir(sandbox) / "0001-a.patch").write_text(_shift_hunk(text, 7))
    add_to_series(sandbox, "0001-a.patch")
    before = tree_digest(sandbox)
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5 and "0001-a.patch" in proc.stderr and "offset" in proc.stderr
    # Fuzz: the first context line no longer matches.
    lines = text.split("\n")
    first_ctx = next(i for i, l in enumerate(lines) if l.startswith("@@")) + 1
    lines[first_ctx] = " # a context line that upstream does not have"
    (series_dir(sandbox) / "0001-a.patch").write_text("\n".join(lines))
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5 and "fuzz" in proc.stderr
    # Conflict: the changed line itself is different upstream.
    conflict = text.replace(
        "-    overlap_grad_reduce: bool = False", "-    overlap_grad_reduce: int = 3"
    )
    (series_dir(sandbox) / "0001-a.patch").write_text(conflict)
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5
    assert re.search(
        r"0001-a\.patch: file \S+distributed_data_parallel_config\.py: hunk #1 FAILED", proc.stderr
    )
    assert tree_digest(sandbox) == before


def test_series_entry_without_file_and_file_not_in_series(sandbox):
    add_to_series(sandbox, "0001-missing.patch")
    proc = run(sandbox, "materialize")
    assert (
        proc.returncode == 2
        and "0001-missing.patch" in proc.stderr
        and "does not exist" in proc.stderr
    )
    (series_dir(sandbox) / "series").write_text("")
    flip_overlap(sandbox, "0002-stray.patch")
    proc = run(sandbox, "check")
    assert (
        proc.returncode == 1
        and "patches/0.18.2/0002-stray.patch is not listed in patches/0.18.2/series" in proc.stderr
    )


def test_a_patch_message_over_40_lines_fails_check(tmp_path):
    """check names a patch whose message (Subject to the diffstat) is over 40 lines, with its
    length; 40 lines pass."""
    sys.path.insert(0, str(REPO / "tools"))
    from megatron_fork import check  # pylint: disable=import-outside-toplevel

    work = tmp_path / "work"
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    (work / "a.py").parent.mkdir(parents=True)
    (work / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    patch_dir = tmp_path / "patches" / BASE
    patch_dir.mkdir(parents=True)
    for name, body_lines in (("0001-short.patch", 36), ("0002-long.patch", 37)):
        (work / "a.py").write_text(f"x = {body_lines}\n")
        body = "\n".join(f"line {i}" for i in range(body_lines))
        message = f"test: {name}\n\n{body}\n\nForwarded: no"
        subprocess.run([*git, "commit", "-qam", message], check=True)
        (patch_dir / name).write_text(format_patch(git))
    (patch_dir / "series").write_text("0001-short.patch\n0002-long.patch\n")
    assert check.message_lines(patch_dir / "0001-short.patch") == 40
    assert check.metadata_failures(BASE, patch_dir, {}) == [
        f"patches/{BASE}/0002-long.patch: message is 41 lines, over 40"
    ]


def test_wheel_hash_mismatch_is_refused(sandbox, tmp_path):
    bad_dir = tmp_path / "wheels"
    bad_dir.mkdir()
    name = "megatron_core-0.18.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(bad_dir / name, "w") as zf:
        zf.writestr("megatron/core/__init__.py", "# not upstream\n")
    before = tree_digest(sandbox)
    proc = run(sandbox, "materialize", "--force", "--wheel", str(bad_dir / name))
    assert proc.returncode == 3 and "sha256 mismatch" in proc.stderr and name in proc.stderr
    assert tree_digest(sandbox) == before


def test_missing_upstream_offline(sandbox, tmp_path):
    before = tree_digest(sandbox)
    proc = run(
        sandbox,
        "materialize",
        "--force",
        "--offline",
        env={"MEGATRON_FORK_CACHE": str(tmp_path / "empty")},
    )
    assert proc.returncode == 4 and "not available offline" in proc.stderr
    assert tree_digest(sandbox) == before


def test_offline_from_local_git_checkout_at_named_revision(sandbox, tmp_path):
    checkout = tmp_path / "Megatron-LM"
    shutil.copytree(sandbox / "megatron", checkout / "megatron")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "v"], check=True)
    subprocess.run([*git, "tag", "core_v0.18.2"], check=True)
    env = {"MEGATRON_FORK_CACHE": str(tmp_path / "empty")}
    proc = run(
        sandbox,
        "materialize",
        "--force",
        "--offline",
        "--git-repo",
        str(checkout),
        "--rev",
        "core_v0.18.2",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    (checkout / TARGET).write_text("# changed\n")
    subprocess.run([*git, "commit", "-qam", "drift"], check=True)
    proc = run(
        sandbox, "materialize", "--force", "--git-repo", str(checkout), "--rev", "HEAD", env=env
    )
    assert proc.returncode == 3 and "is not megatron-core 0.18.2" in proc.stderr


# Runs the sandbox's CLI in-process with the step that checks each patch wrapped: before the
# patch numbered argv[2] (0-based) it raises KeyboardInterrupt ("interrupt", as Ctrl-C would)
# or says "paused" and sleeps, so that the test sends a real signal mid-series ("pause").
MIDWAY = """
import sys, time
sys.path.insert(0, "tools")
from megatron_fork import cli, queue
action, at, real, seen = sys.argv[1], int(sys.argv[2]), queue.classify, []
def classify(patch, tree):
    if len(seen) == at and action == "interrupt":
        raise KeyboardInterrupt(f"interrupted before patch {at}")
    if len(seen) == at:
        print("paused", file=sys.stderr, flush=True)
        time.sleep(120)
    seen.append(patch.name)
    return real(patch, tree)
queue.classify = classify
sys.exit(cli.main(sys.argv[3:]))
"""


def midway(sandbox, action, at, *args):
    """Start the sandbox's CLI with ``args`` under MIDWAY (see there); return the Popen."""
    return subprocess.Popen(
        [sys.executable, "-c", MIDWAY, action, str(at), *args],
        cwd=sandbox,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_interrupted_apply_leaves_previous_tree(sandbox):
    flip_overlap(sandbox, "0001-a.patch")
    make_patch(
        sandbox,
        "0002-b.patch",
        "use_distributed_optimizer: bool = False",
        "use_distributed_optimizer: bool = True",
        subject="test: b",
    )
    add_to_series(sandbox, "0001-a.patch", "0002-b.patch")
    before = tree_digest(sandbox)
    proc = midway(sandbox, "interrupt", 1, "materialize")
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and "left as it was" in err, err
    assert "interrupted before patch 1" in err  # the first patch was applied, in the temporary tree
    assert tree_digest(sandbox) == before
    assert not list((sandbox / "build").glob(".materialize-*"))


def test_base_and_series_answer_the_scripts(sandbox):
    make_patch(
        sandbox,
        "0001-a.patch",
        "overlap_grad_reduce: bool = False",
        "overlap_grad_reduce: bool = True",
    )
    (series_dir(sandbox) / "series").write_text("# the series\n0001-a.patch  # a comment\n\n")
    for args in (("base",), ("base", "--default"), ("base", "--releases"),
                 ("base", "--materialized")):  # fmt: skip
        proc = run(sandbox, *args)
        assert (proc.returncode, proc.stdout) == (0, f"{BASE}\n"), (args, proc.stderr)
    proc = run(sandbox, "series")
    assert (proc.returncode, proc.stdout) == (0, "0001-a.patch\n"), proc.stderr
    shutil.rmtree(sandbox / "megatron")
    proc = run(sandbox, "base", "--materialized")
    assert proc.returncode == 1 and "not materialized: run `tools/fork.py materialize`" in (
        _one_line(proc)
    )
    assert run(sandbox, "base").stdout == f"{BASE}\n"  # the pin's default
    proc = run(sandbox, "series", "--base", "9.9.9")
    assert proc.returncode == 2 and "unknown base '9.9.9'" in _one_line(proc)


def test_status_classifies_clean_offset_fuzz_conflict_and_upstream(sandbox):
    pristine = (sandbox / TARGET).read_text()
    flip_overlap(sandbox, "0001-clean.patch")
    off = make_patch(
        sandbox,
        "0002-off.patch",
        "use_distributed_optimizer: bool = False",
        "use_distributed_optimizer: bool = True",
        subject="b",
    )
    (series_dir(sandbox) / "0002-off.patch").write_text(_shift_hunk(off, 9))
    # "upstream": a patch whose result is what the base already has.
    (sandbox / TARGET).write_text(
        pristine.replace(
            "check_for_nan_in_grad: bool = False", "check_for_nan_in_grad: bool = None", 1
        )
    )
    work = sandbox / TARGET
    assert "check_for_nan_in_grad: bool = None" in work.read_text()
    up = make_patch(
        sandbox,
        "0003-up.patch",
        "check_for_nan_in_grad: bool = None",
        "check_for_nan_in_grad: bool = False",
        subject="c",
    )
    (sandbox / TARGET).write_text(pristine)
    assert "bool = None" not in (sandbox / TARGET).read_text() and up
    bad = make_patch(
        sandbox,
        "0004-conflict.patch",
        "check_for_large_grads: bool = False",
        "check_for_large_grads: bool = True",
        subject="d",
    )
    (series_dir(sandbox) / "0004-conflict.patch").write_text(
        bad.replace(
            "-    check_for_large_grads: bool = False", "-    check_for_large_grads: str = 'x'"
        )
    )
    add_to_series(
        sandbox, "0001-clean.patch", "0002-off.patch", "0003-up.patch", "0004-conflict.patch"
    )
    proc = run(sandbox, "status", "--base", "0.18.2")
    assert proc.returncode == 0, proc.stderr
    rows = {l.split()[0]: l.split()[1] for l in proc.stdout.splitlines() if l.startswith("000")}
    assert rows == {
        "0001-clean.patch": "clean",
        "0002-off.patch": "offset",
        "0003-up.patch": "upstream",
        "0004-conflict.patch": "CONFLICT",
    }
    assert "0003-up.patch: found upstream in 0.18.2" in proc.stdout
    # Offset and conflict details name patch, file and hunk.
    assert re.search(
        r"0002-off\.patch: file \S+_config\.py: hunk #1 at line \d+ \(offset -?9", proc.stdout
    )


def test_upstream_commit_trailer_is_verified_against_the_tree(tmp_path):
    """A backport in our own words counts as upstream only if upstream's commit reverse-applies."""
    sys.path.insert(0, str(REPO / "tools"))
    from megatron_fork.series import Patch  # pylint: disable=import-outside-toplevel
    from megatron_fork.status import (  # pylint: disable=import-outside-toplevel
        contains_upstream_commit,
    )

    repo = tmp_path / "upstream"
    (repo / "megatron").mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    lines = [f"line {i}\n" for i in range(20)]
    (repo / "megatron" / "m.py").write_text("".join(lines))
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    lines[10] = "line 10 fixed upstream's way\n"
    (repo / "megatron" / "m.py").write_text("".join(lines))
    subprocess.run([*git, "commit", "-qam", "fix"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    patch = Patch(name="0001-x.patch", path=tmp_path / "x.patch", upstream_commits=[sha])
    patch.files = ["megatron/m.py"]
    fixed, old = tmp_path / "fixed", tmp_path / "old"
    for tree, content in ((fixed, repo / "megatron" / "m.py"), (old, None)):
        (tree / "megatron").mkdir(parents=True)
        text = content.read_text() if content else "".join(f"line {i}\n" for i in range(20))
        (tree / "megatron" / "m.py").write_text(text)
    assert contains_upstream_commit(patch, fixed, repo).startswith("contains upstream commit")
    assert contains_upstream_commit(patch, old, repo) is None
    assert contains_upstream_commit(patch, fixed, None) is None


# Tool faults: every one gives its documented exit code and one line, and nothing is half done.


def make_two_file_patch(sandbox, name):
    """A format-patch (with diffstat) that changes TARGET and a second file."""
    other = "megatron/core/distributed/__init__.py"
    work, git = work_repo(sandbox, f"work2-{name}", (TARGET, other))
    text = (work / TARGET).read_text()
    (work / TARGET).write_text(
        text.replace("overlap_grad_reduce: bool = False", "overlap_grad_reduce: bool = True", 1)
    )
    with open(work / other, "a") as f:
        f.write("# a second file\n")
    subprocess.run([*git, "commit", "-qam", "two files\n\nBody.\n\nForwarded: no"], check=True)
    return format_patch(git), other


def test_patch_truncated_at_a_file_boundary_is_exit_5_naming_the_lost_file(sandbox):
    text, other = make_two_file_patch(sandbox, "0001-two.patch")
    sections = text.split("\ndiff --git ")
    lost = next(i for i, sec in enumerate(sections) if sec.startswith(f"a/{other}"))
    cut = "\ndiff --git ".join(s for i, s in enumerate(sections) if i != lost)
    (series_dir(sandbox) / "0001-two.patch").write_text(cut)
    add_to_series(sandbox, "0001-two.patch")
    before = tree_digest(sandbox)
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5, proc.stderr
    assert "0001-two.patch" in proc.stderr and "incomplete diff" in proc.stderr
    assert other in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert tree_digest(sandbox) == before


def test_offset_and_fuzz_name_patch_file_and_hunk(sandbox):
    text = flip_overlap(sandbox, "0001-a.patch")
    (series_dir(sandbox) / "0001-a.patch").write_text(_shift_hunk(text, 7))
    add_to_series(sandbox, "0001-a.patch")
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5
    assert re.search(
        r"0001-a\.patch: file \S+_config\.py: hunk #1 at line \d+ \(offset -7 lines\)", proc.stderr
    )
    lines = text.split("\n")
    first_ctx = next(i for i, l in enumerate(lines) if l.startswith("@@")) + 1
    lines[first_ctx] = " # a context line that upstream does not have"
    (series_dir(sandbox) / "0001-a.patch").write_text("\n".join(lines))
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5
    assert re.search(
        r"0001-a\.patch: file \S+_config\.py: hunk #1 at line \d+ with fuzz \d", proc.stderr
    )


FAULT = """
import errno, os, shutil, sys
sys.path.insert(0, "tools")
from megatron_fork import cli
kind = sys.argv[1]
def fail(code, name):
    def raiser(*a, **k):
        raise OSError(code, os.strerror(code), name)
    return raiser
if kind == "exdev":
    os.rename = fail(errno.EXDEV, "megatron")
elif kind == "enospc":
    shutil.copyfileobj = fail(errno.ENOSPC, "build/.materialize-x")
elif kind == "rocache":
    import tempfile
    tempfile.TemporaryDirectory = fail(errno.EROFS, os.environ["MEGATRON_FORK_CACHE"])
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    "kind,words",
    [("exdev", "cross file systems"), ("enospc", "no space left"), ("rocache", "read-only")],
)
def test_io_faults_are_exit_9_with_one_line_and_tree_untouched(sandbox, tmp_path, kind, words):
    before = tree_digest(sandbox)
    env = {**os.environ}
    args = ["materialize", "--force"]
    if kind == "rocache":
        env["MEGATRON_FORK_CACHE"] = str(tmp_path / "ro-cache")
        (tmp_path / "ro-cache").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", FAULT, kind, *args],
        cwd=sandbox,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 9, proc.stderr
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree_digest(sandbox) == before
    assert not list((sandbox / "build").glob(".materialize-*"))
    assert not list((sandbox / "build").glob(".previous-*"))


def test_corrupt_wheel_with_matching_hash_is_exit_9(sandbox, tmp_path):
    name = "megatron_core-0.18.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    bad = tmp_path / "wheels" / name
    bad.parent.mkdir()
    bad.write_bytes(b"PK\x03\x04 this is not a whole zip archive")
    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    pin = sandbox / "patches" / "upstream.toml"
    text = pin.read_text()
    pin.write_text(
        text.replace("c2717b84079bf0bad1151525533a251870d1a86201f8c0702e0b5a6d6b5594f1", digest)
    )
    before = tree_digest(sandbox)
    proc = run(sandbox, "materialize", "--force", "--wheel", str(bad))
    assert proc.returncode == 9 and "corrupt archive" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert tree_digest(sandbox) == before


def test_lock_keeps_two_runs_apart(sandbox):
    import fcntl  # pylint: disable=import-outside-toplevel

    with open(sandbox / "build" / ".materialize.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        proc = run(sandbox, "materialize", "--force", env={"MEGATRON_FORK_LOCK_WAIT": "1"})
    assert proc.returncode == 7 and "holds" in proc.stderr, proc.stderr
    assert run(sandbox, "materialize", "--force").returncode == 0


@pytest.mark.parametrize("sig,code", [(2, 130), (15, 143)])
def test_sigint_and_sigterm_leave_the_tree_and_no_temporary_folder(sandbox, sig, code):
    flip_overlap(sandbox, "0001-a.patch")
    add_to_series(sandbox, "0001-a.patch")
    before = tree_digest(sandbox)
    proc = midway(sandbox, "pause", 0, "materialize")
    assert proc.stderr.readline().strip() == "paused"
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == code and "left as it was" in err, err
    assert tree_digest(sandbox) == before
    assert not list((sandbox / "build").glob(".materialize-*"))


def test_stale_temporary_folders_of_killed_runs_are_removed(sandbox):
    stale = sandbox / "build" / ".materialize-killed"
    (stale / "megatron").mkdir(parents=True)
    (sandbox / "build" / ".previous-killed").mkdir()
    assert run(sandbox, "materialize", "--force").returncode == 0
    assert not stale.exists() and not (sandbox / "build" / ".previous-killed").exists()


def test_offline_kit_fetch_dest_then_offline_materialize(sandbox, tmp_path):
    kit = tmp_path / "whl"
    proc = run(sandbox, "fetch", "--base", BASE, "--dest", str(kit))
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in kit.glob("*.whl")] == [
        "megatron_core-0.18.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    ]
    # The documented recipe (`fetch --wheel-dir DIR`) fills the folder as well.
    kit2 = tmp_path / "whl2"
    assert run(sandbox, "fetch", "--base", BASE, "--wheel-dir", str(kit2)).returncode == 0
    assert len(list(kit2.glob("*.whl"))) == 1
    env = {"MEGATRON_FORK_CACHE": str(tmp_path / "empty")}
    proc = run(sandbox, "materialize", "--force", "--offline", "--wheel-dir", str(kit), env=env)
    assert proc.returncode == 0, proc.stderr


def _upstream_repo(sandbox, tmp_path, edit=None):
    """A git repo whose HEAD is the sandbox's pristine 0.18.2 tree, optionally edited."""
    repo = tmp_path / "Megatron-LM"
    shutil.copytree(sandbox / "build" / "trees" / "pristine-0.18.2" / "megatron", repo / "megatron")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "upstream"], check=True)
    if edit:
        path = repo / TARGET
        path.write_text(path.read_text().replace(*edit, 1))
        subprocess.run([*git, "commit", "-qam", "upstream moves on"], check=True)
    return repo


def _rebase_onto_head(sandbox, repo):
    """``rebase --base BASE --onto HEAD`` of ``repo`` into a new series named 'next'."""
    args = ["--base", BASE, "--onto", "HEAD", "--git-repo", str(repo), "--name", "next"]
    return run(sandbox, "rebase", *args)


def _one_patch_and_moved_upstream(sandbox, tmp_path, edit):
    """Series = one patch (0001-a.patch); an upstream repo whose HEAD applies ``edit``."""
    flip_overlap(sandbox, "0001-a.patch")
    add_to_series(sandbox, "0001-a.patch")
    assert run(sandbox, "pristine", BASE).returncode == 0
    return _upstream_repo(sandbox, tmp_path, edit=edit)


def test_rebase_carries_the_series_and_prints_range_diff(sandbox, tmp_path):
    # Upstream inserts lines above the patched one: the patch needs an offset there.
    edit = ("class DistributedDataParallelConfig:", "class DistributedDataParallelConfig:\n\n\n")
    repo = _one_patch_and_moved_upstream(sandbox, tmp_path, edit)
    proc = _rebase_onto_head(sandbox, repo)
    assert proc.returncode == 0, proc.stderr
    assert "kept    0001-a.patch" in proc.stdout and "git range-diff" in proc.stdout
    assert (series_dir(sandbox).parent / "next" / "series").read_text() == "0001-a.patch\n"
    assert not (sandbox / "build" / "rebase").exists()


def test_rebase_stops_at_a_conflict_naming_patch_file_and_hunk_and_abort_loses_nothing(
    sandbox, tmp_path
):
    edit = ("overlap_grad_reduce: bool = False", "overlap_grad_reduce: int = 0")
    repo = _one_patch_and_moved_upstream(sandbox, tmp_path, edit)
    before = (series_dir(sandbox) / "0001-a.patch").read_text()
    proc = _rebase_onto_head(sandbox, repo)
    assert proc.returncode == 8, proc.stderr
    assert re.search(
        r"patch 0001-a\.patch conflicts\n  file \S+_config\.py: hunk at line \d+", proc.stderr
    )
    # A second rebase refuses while one is in progress; --abort removes it; nothing was written.
    proc = run(sandbox, "rebase", "--base", BASE, "--onto", "HEAD", "--git-repo", str(repo))
    assert proc.returncode == 2 and "in progress" in proc.stderr
    assert run(sandbox, "rebase", "--abort").returncode == 0
    assert not (sandbox / "build" / "rebase").exists()
    assert not (series_dir(sandbox).parent / "next").exists()
    assert (series_dir(sandbox) / "0001-a.patch").read_text() == before


MAIN = "d98e8a64"  # Megatron-LM main, 2026-08: has #5916 (cd4afffa64) and has moved on since


@tiers.skipif(not os.environ.get("FORK_MEGATRON_LM"), "megatron-lm", "FORK_MEGATRON_LM is not set")
def test_status_names_a_merged_backport_upstream_on_a_ref_that_moved_on():
    """0008 and 0010 conflict on main, but main contains #5916: status says upstream, and why."""
    mirror = Path(os.environ["FORK_MEGATRON_LM"])
    has_main = ["git", "-C", str(mirror), "cat-file", "-e", f"{MAIN}^{{commit}}"]
    assert (
        subprocess.run(has_main, capture_output=True).returncode == 0
    ), f"FORK_MEGATRON_LM={mirror} lacks Megatron-LM main commit {MAIN}: fetch it there"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "fork.py"), "status", "--git-repo", str(mirror),
         "--rev", MAIN],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {l.split()[0]: l.split()[1] for l in proc.stdout.splitlines() if len(l.split()) == 2}
    assert rows["expert-dp-sync-ep1"] == "upstream"
    assert rows["param-norm-expert-tp-dedup"] == "upstream"
    assert rows["layer-wise-expert-grad-stats"] == "CONFLICT"  # not upstream: stays a conflict
    assert f"expert-dp-sync-ep1: upstream commit cd4afffa64 is an ancestor of {MAIN}" in proc.stdout


def test_patch_adding_an_upstream_layout_test_is_tracked_by_the_queue(sandbox):
    """A patch may add its regression test under tests/unit_tests/ (upstream's layout).

    materialize places it beside megatron/, commit/export carry edits to it, a series without it
    removes it, and a file name containing 'offset' is no hunk offset.
    """
    test_rel = "tests/unit_tests/distributed/test_offset_and_fuzz_names.py"
    work, git = work_repo(sandbox, "work-unit-test")
    text = (work / TARGET).read_text()
    (work / TARGET).write_text(
        text.replace("overlap_grad_reduce: bool = False", "overlap_grad_reduce: bool = True", 1)
    )
    (work / test_rel).parent.mkdir(parents=True)
    (work / test_rel).write_text("def test_default():\n    assert True\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run(
        [*git, "commit", "-qm", "test: change a default\n\nBody.\n\nForwarded: no"], check=True
    )
    (series_dir(sandbox) / "0001-a.patch").write_text(format_patch(git))
    add_to_series(sandbox, "0001-a.patch")

    proc = run(sandbox, "materialize")
    assert proc.returncode == 0, proc.stderr
    assert (sandbox / test_rel).read_text().startswith("def test_default")
    assert run(sandbox, "export").returncode == 0
    proc = run(sandbox, "check")
    assert proc.returncode == 0, proc.stderr

    (sandbox / test_rel).write_text((sandbox / test_rel).read_text() + "# edited\n")
    proc = run(sandbox, "materialize")
    assert proc.returncode == 6 and test_rel in proc.stderr
    assert run(sandbox, "commit", "--to", "0001-a.patch").returncode == 0
    assert run(sandbox, "export").returncode == 0
    assert "+# edited" in (series_dir(sandbox) / "0001-a.patch").read_text()
    assert run(sandbox, "check").returncode == 0

    (series_dir(sandbox) / "series").write_text("")
    (series_dir(sandbox) / "0001-a.patch").unlink()
    proc = run(sandbox, "materialize", "--force")
    assert proc.returncode == 0, proc.stderr
    assert not (sandbox / "tests" / "unit_tests").exists()
    assert "overlap_grad_reduce: bool = False" in (sandbox / TARGET).read_text()


# Each error is one line that names the base, the patch, the file and the next thing to try,
# with its documented exit code (docs/maintaining.md, exit codes).


def _one_line(proc):
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_file_missing_from_the_tree_is_named(sandbox):
    # 0008 on 0.17.1 (and on Primus's pin) patches megatron/training/utils/common_utils.py, which
    # those trees lack; the message used to say "file ?".
    text = flip_overlap(sandbox, "0001-a.patch")
    missing = "megatron/training/not_in_this_tree.py"
    (series_dir(sandbox) / "0001-a.patch").write_text(
        text.replace("megatron/core/distributed/distributed_data_parallel_config.py", missing)
    )
    add_to_series(sandbox, "0001-a.patch")
    before = tree_digest(sandbox)
    proc = run(sandbox, "materialize")
    line = _one_line(proc)
    assert proc.returncode == 5, proc.stderr
    assert f"file {missing}: does not exist in the tree" in line and "file ?" not in line
    assert line.count("does not exist") == 1
    assert tree_digest(sandbox) == before


@pytest.mark.parametrize("entry", ["0001-a.patch", "fork/0001-a.patch"])
def test_a_truncated_patch_is_named_with_its_base(sandbox, entry):
    text = flip_overlap(sandbox, "0001-a.patch")
    (series_dir(sandbox) / "0001-a.patch").unlink()
    (series_dir(sandbox) / entry).parent.mkdir(parents=True, exist_ok=True)
    (series_dir(sandbox) / entry).write_text(text[: text.rindex("@@") + 40])
    add_to_series(sandbox, entry)
    proc = run(sandbox, "materialize")
    assert proc.returncode == 5
    assert f"patch patches/{BASE}/{entry}: truncated inside hunk" in _one_line(proc)


@pytest.mark.parametrize(
    "args",
    [
        ("materialize", "--base", "9.9.9"),
        ("check", "--base", "9.9.9"),
        ("status", "--base", "9.9.9"),
        ("pristine", "9.9.9"),
        ("fetch", "--base", "9.9.9"),
    ],
)
def test_an_unknown_base_is_named_as_unknown(sandbox, args):
    proc = run(sandbox, *args)
    line = _one_line(proc)
    assert proc.returncode == 2, proc.stderr
    assert "unknown base '9.9.9'" in line and "0.18.2" in line and "series" not in line


def test_no_network_names_pips_reason_and_the_offline_routes(sandbox, tmp_path):
    env = {
        "MEGATRON_FORK_CACHE": str(tmp_path / "empty"),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    proc = run(sandbox, "fetch", "--base", BASE, env=env)
    line = _one_line(proc)
    assert proc.returncode == 4, proc.stderr
    assert line.startswith(f"error: could not download megatron-core {BASE} (ERROR: ")
    assert "--offline --wheel-dir DIR" in line and f"fetch --base {BASE} --dest DIR" in line
    assert "--git-repo PATH-TO-Megatron-LM (tag core_v0.18.2)" in line
    reason = line.split(" (", 1)[1].split("); without network", 1)[0]
    assert reason.endswith((" ...", ")")) or reason[-1].isalnum() or reason[-1] in ".'\"", reason


def test_a_waiting_run_says_what_it_waits_for_at_once(sandbox):
    lock = sandbox / "build" / ".materialize.lock"
    with open(lock, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write("pid 4242, since 12:00:00: tools/fork.py materialize --base 0.18.2\n")
        handle.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, str(sandbox / "tools" / "fork.py"), "materialize", "--force"],
            cwd=sandbox,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "MEGATRON_FORK_LOCK_WAIT": "20"},
        )
        first = proc.stderr.readline()
        waited = time.monotonic() - t0
        proc.kill()
        proc.communicate()
    assert waited < 15, waited
    assert first.startswith(f"waiting for {lock}, held by pid 4242") and "exit 7" in first
    proc = run(sandbox, "materialize", "--force")
    assert proc.returncode == 0, proc.stderr
    assert lock.read_text() == ""  # released: no stale holder is named later


def test_the_lock_names_its_holder_when_it_gives_up(sandbox):
    # The holder is a real run of the tool's lock (queue.locked), not a hand-made flock.
    code = (
        "import sys, time; sys.path.insert(0, 'tools')\n"
        "from megatron_fork import queue\n"
        "with queue.locked(queue.Workspace(sys.argv[1])):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(sandbox)], cwd=sandbox, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run(sandbox, "materialize", "--force", env={"MEGATRON_FORK_LOCK_WAIT": "1"})
    finally:
        holder.kill()
        holder.communicate()
    assert proc.returncode == 7
    assert f"(pid {holder.pid}, since " in proc.stderr
    assert re.search(r"waited 1 s\); try again", proc.stderr)


def test_check_without_a_checkout_does_not_pass_for_every_base(sandbox):
    pin = sandbox / "patches" / "upstream.toml"
    pin.write_text(
        re.sub(r'(?m)^maintained = .*$', f'maintained = ["dev", "{BASE}"]', pin.read_text())
    )
    proc = run(sandbox, "check")
    assert proc.returncode == 4, (proc.stdout, proc.stderr)
    assert f"check {BASE}" in proc.stdout  # the release was checked
    line = _one_line(proc)
    assert "check dev: not checked" in line and "--git-repo PATH-TO-Megatron-LM" in line
    assert run(sandbox, "check", "--base", BASE).returncode == 0


def test_git_repo_cannot_build_a_wheel_that_no_ref_equals(sandbox, tmp_path):
    # core_r0.19.0 is a branch at 0.19.1: no Megatron-LM ref equals the 0.19.2 wheel.
    proc = run(
        sandbox, "pristine", "0.19.2", "--git-repo", str(tmp_path), "--dest", str(tmp_path / "t")
    )
    line = _one_line(proc)
    assert proc.returncode == 4, proc.stderr
    assert (
        "megatron-core 0.19.2: no Megatron-LM ref equals its wheel (nearest: core_r0.19.0" in line
    )
    assert "--offline --wheel-dir DIR" in line


RELEASES = ["0.18.2", "0.19.2"]


@pytest.mark.parametrize("base", RELEASES)
def test_the_offline_wheel_kit_builds_every_release(sandbox, tmp_path, base):
    kit = tmp_path / "kit"
    assert run(sandbox, "fetch", "--base", base, "--dest", str(kit)).returncode == 0
    env = {"MEGATRON_FORK_CACHE": str(tmp_path / "empty"), "PIP_INDEX_URL": "http://127.0.0.1:9/"}
    dest = tmp_path / "tree"
    proc = run(
        sandbox,
        "pristine",
        base,
        "--offline",
        "--wheel-dir",
        str(kit),
        "--dest",
        str(dest),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert (dest / "megatron" / "core" / "package_info.py").is_file()


@tiers.skipif(not os.environ.get("FORK_TEST_DEV_REPO"), "dev", "FORK_TEST_DEV_REPO is not set")
def test_the_git_tag_of_0_18_2_equals_its_wheel(sandbox, tmp_path):
    repo = os.environ["FORK_TEST_DEV_REPO"]
    proc = run(sandbox, "pristine", "0.18.2", "--git-repo", repo, "--dest", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
