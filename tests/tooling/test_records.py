"""The change records (patches/changes.toml) are the one place a change's facts live.

The change table of docs/changes.md (one heading per family), the README's count of the
changes, tests/README.md's map to the tests and every patch's trailers, author and opening line
are generated from them: `tools/fork.py records` and `check` fail on any disagreement, naming the
file, and `records --write` puts it right. These tests run on a copy of this repository's own
patches/, docs/changes.md and README.md, so they also pin that the committed files agree with the
records.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from megatron_fork import (  # noqa: E402  pylint: disable=wrong-import-position
    compat,
    evidence,
    records,
    upstream,
)

PIN = upstream.load_pin(REPO / "patches" / "upstream.toml")
N_CHANGES = len(records.load(REPO / "patches", PIN["maintained"]))


@pytest.fixture
def copy(tmp_path):
    """A copy of tools/, patches/, README.md, docs/changes.md, tests/README.md and the
    compatibility records: a workspace the tests may break."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "patches", root / "patches")
    shutil.copy(REPO / "README.md", root / "README.md")
    (root / "docs").mkdir()
    shutil.copy(REPO / "docs" / "changes.md", root / "docs" / "changes.md")
    (root / "tests").mkdir()
    shutil.copy(REPO / "tests" / "README.md", root / "tests" / "README.md")
    shutil.copytree(REPO / compat.DATA, root / compat.DATA)
    return root


def fork(root, *args):
    """Run the copy's tools/fork.py."""
    return subprocess.run(
        [sys.executable, str(root / "tools" / "fork.py"), *args],
        cwd=root,
        capture_output=True,
        text=True,
    )


def edit(path, old, new):
    """Replace ``old`` (which must occur) with ``new`` in ``path``."""
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_the_committed_files_agree_with_the_records():
    """Change table, README count, trailers, backport authors and opening lines: generated, not
    hand-kept."""
    assert records.plan(REPO / "patches", PIN).drift() == []
    changes = records.load(REPO / "patches", PIN["maintained"])
    carried = {
        (base, slug)
        for slug, c in changes.items()
        for base, state in c.bases.items()
        if state == "carried"
    }
    in_series = set()
    for base in PIN["maintained"]:
        for entry in (REPO / "patches" / base / "series").read_text().split():
            slug = re.match(r"^\w+/\d{4}-(.+)\.patch$", entry).group(1)
            in_series.add((base, slug))
    assert carried == in_series
    on_branch = evidence.paths(REPO)  # None in a clone without the branch: not checked there
    for c in changes.values():
        for path in c.tests + c.docs:
            if path.startswith("evidence:"):  # the evidence branch (docs/evidence.md)
                assert on_branch is None or path[len("evidence:") :] in on_branch, path
            else:
                assert (REPO / path).is_file(), f"{c.slug}: {path} does not exist"
    # Every regression test file at the top of tests/ pins some change.
    top = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}
    assert top == set(records.counterfactual_files(changes))


P18, P19, DEV = "patches/0.18.2", "patches/0.19.2", "patches/dev"
HAND_EDITS = {
    "changes-row": (
        "docs/changes.md",
        "| 0013 `ddp-grad-ready-microbatch-count` | with",
        "| 0013 `ddp-grad-ready-microbatch-count` | With",
    ),
    "changes-heading": (
        "docs/changes.md",
        "## Warmup and calibration\n",
        "## Warmup and DDP calibration\n",
    ),
    "readme-count": ("README.md", f"\n{N_CHANGES} changes,", f"\n{N_CHANGES + 1} changes,"),
    "readme-compat": ("README.md", "| not checked |", "| works |"),
    "tests-readme": (
        "tests/README.md",
        "| 0021 `expert-gtp-grad-sync` | `tests/test_expert_gtp_grads.py` |",
        "| 0021 `expert-gtp-grad-sync` | |",
    ),
    "forwarded": (
        f"{P18}/fork/0008-attention-sink-offset-tensor-parallel.patch",
        "Forwarded: https://github.com/NVIDIA/Megatron-LM/pull/7530",
        "Forwarded: no",
    ),
    "requires": (
        f"{DEV}/fork/0013-ddp-grad-ready-microbatch-count.patch",
        "Requires: ddp-name-params-without-grad\n",
        "",
    ),
    "backport-author": (
        f"{P19}/backports/0014-distopt-fully-reshardable-bucket-padding.patch",
        "From: Deepak Narayanan",
        "From: megatron-fork",
    ),
    "backport-opening": (
        f"{P18}/backports/0017-grad-norm-empty-grads.patch",
        "commit 3c4645201af547141cd5c91bfcfb3e05786fdce1 upstream.\n\n",
        "",
    ),
}


@pytest.mark.parametrize("target, old, new", HAND_EDITS.values(), ids=HAND_EDITS.keys())
def test_a_hand_edit_of_a_generated_place_fails_records_and_check(copy, target, old, new):
    """Each generated place: the edit is named by `records` and by `check` (before anything is
    materialized), and `records --write` restores the committed bytes."""
    committed = (copy / target).read_text()
    edit(copy / target, old, new)
    proc = fork(copy, "records")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"1 file(s) disagree with patches/changes.toml: {target}" in proc.stderr
    base = target.split("/")[1] if target.startswith("patches/") else "0.18.2"  # docs: any
    proc = fork(copy, "check", "--base", base, "--offline", "--wheel-dir", str(copy / "none"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{target} disagrees with patches/changes.toml" in proc.stderr
    proc = fork(copy, "records", "--write")
    assert proc.returncode == 0 and f"wrote {target}" in proc.stdout, proc.stderr
    assert (copy / target).read_text() == committed
    assert fork(copy, "records").returncode == 0


def test_a_record_change_reaches_every_base_and_the_change_table(copy):
    """One edit of a record rewrites its docs/changes.md row and the patch on each base that
    carries it."""
    edit(copy / "patches" / "changes.toml", 'forwarded = 7132\n', 'forwarded = [7132, 9999]\n')
    proc = fork(copy, "records", "--write")
    assert proc.returncode == 0, proc.stderr
    wrote = sorted(re.findall(r"wrote (\S+)", proc.stdout))
    assert wrote == ["docs/changes.md"] + sorted(
        f"patches/{b}/fork/0020-layer-wise-param-norm-overlap.patch" for b in PIN["maintained"]
    )
    for b in PIN["maintained"]:
        text = (
            copy / "patches" / b / "fork" / "0020-layer-wise-param-norm-overlap.patch"
        ).read_text()
        assert "Forwarded: https://github.com/NVIDIA/Megatron-LM/pull/7132 " in text
        assert "https://github.com/NVIDIA/Megatron-LM/pull/9999 (open" in text
    assert "upstream PR 7132, 9999" in (copy / "docs" / "changes.md").read_text()
    # A second write changes no byte.
    assert "no byte changed" in fork(copy, "records", "--write").stdout


def test_a_family_edit_moves_the_row_under_the_other_heading(copy):
    """A record's family is its heading in docs/changes.md: a new family moves the row (in number
    order there), and a family left without changes loses its heading; nothing else changes."""
    toml = copy / "patches" / "changes.toml"
    others = toml.read_text().count('family = "other"\n')  # 0012 first, then 0054
    assert others >= 1
    for _ in range(others):
        edit(toml, 'family = "other"\n', 'family = "checkpoints"\n')
    proc = fork(copy, "records", "--write")
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"wrote (\S+)", proc.stdout) == ["docs/changes.md"]
    text = (copy / "docs" / "changes.md").read_text()
    assert "\n## Other\n" not in text
    section = text.split("\n## Checkpoints and resume", 1)[1].split("\n## ", 1)[0]
    numbers = re.findall(r"(?m)^\| (\d{4}) `", section)
    assert numbers[:2] == ["0012", "0014"] and numbers == sorted(numbers), numbers
    assert "0054" in numbers


def test_a_new_record_adds_its_row_and_counts_in_the_readme(copy):
    """A new record (no base carries it yet): its row under its family and in tests/README.md's
    map, the README's count one more; no patch is touched."""
    with open(copy / "patches" / "changes.toml", "a") as f:
        f.write(
            '\n[changes.example-new-change]\nnumber = 999\ngroup = "fork"\n'
            'subject = "example: a new change"\nsummary = "an example"\nfamily = "statistics"\n'
            'forwarded = "no"\ntests = []\nbases = {}\n'
        )
    proc = fork(copy, "records", "--write")
    assert proc.returncode == 0, proc.stderr
    wrote = sorted(re.findall(r"wrote (\S+)", proc.stdout))
    assert wrote == ["README.md", "docs/changes.md", "tests/README.md"], wrote
    assert f"\n{N_CHANGES + 1} changes, by family" in (copy / "README.md").read_text()
    text = (copy / "docs" / "changes.md").read_text()
    section = text.split("\n## Statistics", 1)[1].split("\n## ", 1)[0]
    assert section.rstrip().endswith(
        "| 0999 `example-new-change` | an example | not forwarded | not applicable "
        "| not applicable | not applicable |"
    ), section
    assert fork(copy, "records").returncode == 0


def test_requires_names_a_slug_that_must_come_first_or_be_upstream(copy):
    """`Requires:` names slugs; one that is neither earlier in the series nor upstream on the
    base fails check, naming the patch and the slug."""
    sys.path.insert(0, str(copy / "tools"))
    from megatron_fork import check  # pylint: disable=import-outside-toplevel
    from megatron_fork import records as copy_records  # pylint: disable=import-outside-toplevel

    changes = copy_records.load(copy / "patches")
    for b in PIN["maintained"]:
        assert check.metadata_failures(b, copy / "patches" / b, changes) == []
    # 0011 requires expert-grad-stats, which 0.19.2 has upstream: allowed there.
    assert (
        "Requires: expert-grad-stats"
        in (
            copy / "patches" / "0.19.2" / "fork" / "0011-layer-wise-expert-grad-stats.patch"
        ).read_text()
    )
    series_file = copy / "patches" / "0.18.2" / "series"
    entries = series_file.read_text().split()
    entries.remove("fork/0007-ddp-name-params-without-grad.patch")
    entries.append("fork/0007-ddp-name-params-without-grad.patch")
    series_file.write_text("\n".join(entries) + "\n")
    failures = check.metadata_failures("0.18.2", copy / "patches" / "0.18.2", changes)
    assert failures == [
        "fork/0013-ddp-grad-ready-microbatch-count.patch requires ddp-name-params-without-grad, "
        "which is neither earlier in the series nor upstream in 0.18.2"
    ]


BAD_RECORDS = {
    "forwarded-word": ('forwarded = "no"\n', 'forwarded = "yes"\n', "forwarded 'yes': use no"),
    "backport-author": (
        'author = "Deepak Narayanan <dnarayanan@nvidia.com>"\n',
        "",
        "a backport needs upstream_commit",
    ),
    "requires-unknown": (
        'requires = ["expert-dp-sync-ep1"]',
        'requires = ["expert-dp-sync"]',
        "requires expert-dp-sync, which is not a change",
    ),
    "number-twice": ("number = 21\n", "number = 20\n", "number 20 is also"),
    "unknown-key": ('summary = "`Distributed', 'sumary = "`Distributed', "unknown key 'sumary'"),
    "base": (
        'bases = { "0.19.2" = "carried" }',
        'bases = { "0.19.2" = "carried", "0.17.1" = "carried" }',
        "base '0.17.1' is not maintained",
    ),
    "family-unknown": (
        'family = "statistics"\n',
        'family = "stats"\n',
        "expert-tp-param-dedup: family 'stats' is not one of warmup, microbatches, checkpoints, "
        "moe, statistics, other",
    ),
    "family-missing": (
        'family = "warmup"\n',
        "",
        "ddp-reset-grad-ready-calibration: missing family (family: one of warmup, microbatches, "
        "checkpoints, moe, statistics, other)",
    ),
}


@pytest.mark.parametrize("old, new, words", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_a_bad_record_is_exit_2_naming_the_change(copy, old, new, words):
    """Bad records are refused with one line naming changes.toml, the change and the field."""
    edit(copy / "patches" / "changes.toml", old, new)
    proc = fork(copy, "records")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error: patches/changes.toml: ") and words in line, line
    assert len(line.splitlines()) == 1
