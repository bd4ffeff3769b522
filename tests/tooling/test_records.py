"""The change records (patches/changes.toml) are the one place a change's facts live.

The README's change table and every patch's trailers, author and opening line are generated
from them: `tools/fork.py records` and `check` fail on any disagreement, naming the file, and
`records --write` puts it right. These tests run on a copy of this repository's own patches/
and README.md, so they also pin that the committed files agree with the records.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from megatron_fork import records, upstream  # noqa: E402  pylint: disable=wrong-import-position

PIN = upstream.load_pin(REPO / "patches" / "upstream.toml")


@pytest.fixture
def copy(tmp_path):
    """A copy of tools/, patches/ and README.md: a workspace the tests may break."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "patches", root / "patches")
    shutil.copy(REPO / "README.md", root / "README.md")
    (root / "tests").mkdir()
    shutil.copy(REPO / "tests" / "README.md", root / "tests" / "README.md")
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
    """README table, trailers, backport authors and opening lines: generated, not hand-kept."""
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
    for c in changes.values():
        for path in c.tests + c.docs:
            assert (REPO / path).is_file(), f"{c.slug}: {path} does not exist"
    # Every regression test file at the top of tests/ pins some change.
    top = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}
    assert top == set(records.counterfactual_files(changes))


P18, P19, DEV = "patches/0.18.2", "patches/0.19.2", "patches/dev"
HAND_EDITS = {
    "readme-row": (
        "README.md",
        "| 0013 `ddp-grad-ready-microbatch-count` | with",
        "| 0013 `ddp-grad-ready-microbatch-count` | With",
    ),
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
    base = target.split("/")[1] if target.startswith("patches/") else "0.18.2"  # README: any
    proc = fork(copy, "check", "--base", base, "--offline", "--wheel-dir", str(copy / "none"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{target} disagrees with patches/changes.toml" in proc.stderr
    proc = fork(copy, "records", "--write")
    assert proc.returncode == 0 and f"wrote {target}" in proc.stdout, proc.stderr
    assert (copy / target).read_text() == committed
    assert fork(copy, "records").returncode == 0


def test_a_record_change_reaches_every_base_and_the_readme(copy):
    """One edit of a record rewrites the README row and the patch on each base that carries it."""
    edit(copy / "patches" / "changes.toml", 'forwarded = 7132\n', 'forwarded = [7132, 9999]\n')
    proc = fork(copy, "records", "--write")
    assert proc.returncode == 0, proc.stderr
    wrote = sorted(re.findall(r"wrote (\S+)", proc.stdout))
    assert wrote == ["README.md"] + sorted(
        f"patches/{b}/fork/0020-layer-wise-param-norm-overlap.patch" for b in PIN["maintained"]
    )
    for b in PIN["maintained"]:
        text = (
            copy / "patches" / b / "fork" / "0020-layer-wise-param-norm-overlap.patch"
        ).read_text()
        assert "Forwarded: https://github.com/NVIDIA/Megatron-LM/pull/7132 " in text
        assert "https://github.com/NVIDIA/Megatron-LM/pull/9999 (open" in text
    assert "upstream PR 7132, 9999" in (copy / "README.md").read_text()
    # A second write changes no byte.
    assert "no byte changed" in fork(copy, "records", "--write").stdout


def test_requires_names_a_slug_that_must_come_first_or_be_upstream(copy):
    """`Requires:` names slugs; one that is neither earlier in the series nor upstream on the
    base fails check, naming the patch and the slug."""
    sys.path.insert(0, str(copy / "tools"))
    from megatron_fork import check, series  # pylint: disable=import-outside-toplevel

    changes = series.load_changes(copy / "patches")
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
