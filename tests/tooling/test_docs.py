"""The README is for users and short; no document names a form the project has left behind;
every document is reachable from docs/README.md."""

import re
import subprocess
import sys
from pathlib import Path

from tests.harness import tiers

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
sys.path.insert(0, str(REPO / "tools"))

from megatron_fork import (  # noqa: E402  pylint: disable=wrong-import-position
    evidence,
    records,
    upstream,
)

# Forms the project has left: the single series file, the old trailers, the old message heading,
# an old dev pin. (Results are records of their day and keep their words.)
STALE = {
    r"patches/series\b": "the series file is patches/<base>/series",
    r"Upstream-Status|Upstream-Commit": "trailers are Forwarded/Applied-Upstream/Origin",
    r"^Validation:": "the message heading is Test:",
    r"12eed0a5": "an old dev pin; the pin is patches/upstream.toml's",
    r"results-archive": "no such branch; the measurement data is on the evidence branch",
    r"(?<![\w$/{])results/(?!\{|fork/|compare-)": (
        "results/ is off main: cite evidence:<folder>/<file> (docs/evidence.md)"
    ),
}


def tracked_text_files():
    """Tracked files that hold prose or code (not the measurement data of tests/evidence/data/)."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.split()
    keep = (".md", ".py", ".sh", ".toml", ".txt", ".yml", ".patch")
    return [
        REPO / p
        for p in out
        if p.endswith(keep)
        and not p.startswith("tests/evidence/data/")
        and p != "tests/tooling/test_docs.py"
    ]


def test_the_readme_is_short_and_starts_with_the_routes():
    """At most 100 lines, however many changes there are (their table is docs/changes.md, not a
    README row each); the set-up commands and the three routes come first."""
    lines = README.splitlines()
    assert len(lines) <= 100, len(lines)
    rows = [ln for ln in lines if re.match(r"^\| \d{4} `", ln)]
    assert not rows, f"the README holds change rows (their place is docs/changes.md): {rows[:3]}"
    heads = [ln for ln in lines if ln.startswith("## ")]
    assert heads[:4] == [
        "## Set-up on a fresh machine (two commands)",
        "## 1. Install it in place of `megatron-core`",
        "## 2. Cherry-pick one fix onto your Megatron-LM",
        "## 3. Build CI containers",
    ], heads


def test_docs_changes_lists_every_record_under_its_family():
    """docs/changes.md: one row per record, under the heading of the record's family, in number
    order within a family; the README's change-count line names the number of records."""
    changes = records.load(
        REPO / "patches", upstream.load_pin(REPO / "patches" / "upstream.toml")["maintained"]
    )
    text = (REPO / "docs" / "changes.md").read_text()
    block = text.split(records.CHANGES_BEGIN + "\n", 1)[1].split(records.CHANGES_END, 1)[0]
    under, heading = {}, None
    for line in block.splitlines():
        if line.startswith("## "):
            heading = line[3:]
            assert heading not in under, f"heading {heading!r} twice"
            under[heading] = []
        m = re.match(r"^\| (\d{4}) `([\w-]+)` \|", line)
        if m:
            assert heading is not None, f"row {m.group(2)} before any heading"
            under[heading].append((int(m.group(1)), m.group(2)))
    want = {}
    for c in changes.values():
        want.setdefault(records.FAMILIES[c.family], []).append((c.number, c.slug))
    assert under == {h: sorted(rows) for h, rows in want.items()}
    assert list(under) == [h for h in records.FAMILIES.values() if h in want]
    count = README.split(records.COUNT_BEGIN + "\n", 1)[1].split(records.COUNT_END, 1)[0]
    assert len(count.splitlines()) == 1, count
    assert int(re.match(r"^(\d+) changes\b", count).group(1)) == len(changes), count
    assert "`docs/changes.md`" in count, count


def test_no_document_names_a_left_form():
    """Every tracked prose or code file is free of the forms in STALE."""
    found = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        for pattern, why in STALE.items():
            for m in re.finditer(pattern, text, re.M):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(REPO)}:{line}: {m.group(0)!r} ({why})")
    assert not found, "\n".join(found)


def test_the_readme_version_labels_count_the_carried_patches():
    """`<base>+fork.N.g...` in the README: N is the length of that base's series."""
    labels = re.findall(r"megatron-core (\d+\.\d+\.\d+)\+fork\.(\d+)\.g", README)
    assert labels
    for base, n in labels:
        series = (REPO / "patches" / base / "series").read_text().split()
        assert int(n) == len(series), (base, n, len(series))


def test_every_path_the_readme_names_exists():
    """Each `docs/...`, `tools/...`, `tests/...` or `patches/...` path in the README exists."""
    for rel in set(re.findall(r"`((?:docs|tools|tests|patches)/[^`\s<>]+)`", README)):
        if rel.endswith("/"):
            continue
        assert (REPO / rel).exists(), rel
    for rel in re.findall(r"git am /path/to/fork/(\S+)", README):
        assert (REPO / rel).is_file(), rel


def test_every_document_is_reachable_from_the_docs_index():
    """docs/README.md names every file in docs/, and each file it names exists."""
    index = (REPO / "docs" / "README.md").read_text()
    named = set(re.findall(r"`([\w.-]+\.(?:md|txt))`", index))
    on_disk = {p.name for p in (REPO / "docs").iterdir() if p.name != "README.md"}
    assert on_disk <= named, on_disk - named
    assert {n for n in named if not n.startswith("..")} - {"README.md"} <= on_disk | {"README.md"}
    assert "docs/README.md" in README and "docs/maintaining.md" in README


def test_every_maintainer_tool_has_a_line_and_a_test():
    """tools/maint holds only tools that its README names, each with a test that exists."""
    readme = (REPO / "tools" / "maint" / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([\w.]+)` \| .* \| `(tests/[\w/.]+\.py)`", readme, re.M))
    tools = {
        p.name
        for p in (REPO / "tools" / "maint").iterdir()
        if p.is_file() and p.name != "README.md"
    }
    assert tools == set(rows), (tools, set(rows))
    for tool, test in rows.items():
        assert (REPO / test).is_file(), (tool, test)
        assert tool in (REPO / test).read_text(), f"{test} does not exercise {tool}"


def test_the_demo_imports_without_the_test_dependencies():
    """tools/demo.sh installs no test dependencies: what tools/demo.py imports from the harness
    must not need pytest (a fresh machine's demo failed with ModuleNotFoundError once)."""
    code = (
        "import sys; sys.modules['pytest'] = None; sys.path.insert(0, 'tools'); "
        "import tests.harness, tests.harness.bases, tests.harness.registry; import demo"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_every_evidence_reference_resolves():
    """Each `evidence:<folder>/<file>` that a tracked file cites exists on the evidence branch
    (docs/evidence.md), and each folder that docs/evidence.md indexes is there."""
    paths = evidence.paths(REPO)
    if paths is None:
        tiers.skip(
            "evidence", "this clone has no evidence branch: git fetch origin evidence:evidence"
        )
    missing, cited = [], 0
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        for m in re.finditer(r"evidence:([A-Za-z0-9_.\-/]+)", text):
            target = m.group(1).rstrip("./")
            if target in ("", "evidence"):  # `git fetch origin evidence:evidence`
                continue
            cited += 1
            if target not in paths:
                missing.append(f"{path.relative_to(REPO)}: evidence:{target}")
    assert cited > 20 and not missing, "\n".join(missing)
    index = (REPO / "docs" / "evidence.md").read_text()
    folders = re.findall(r"^\| `([^`]+?)/?` \|", index, re.M)
    assert folders and not [f for f in folders if f.split("`")[0].rstrip("/") not in paths]
