"""The change records (``patches/changes.toml``) and what is generated from them.

One record per change holds its facts once: number, group, subject, a summary for users, where
it stands upstream (DEP-3 vocabulary: ``Forwarded``, ``Applied-Upstream``, ``Bug``, ``Origin``),
what it requires (by slug), its tests and docs, and its state on every maintained base. From the
records the tool writes:

- the trailer block of every patch of every base (and, for a backport, its upstream author in
  ``From:`` and the ``commit <sha> upstream.`` line that opens its message);
- docs/changes.md's change table between ``<!-- changes -->`` markers, one heading per family;
  the README's count of the changes between ``<!-- change-count -->`` markers, and its
  compatibility matrix between ``<!-- compat-matrix -->`` markers (from the check records of
  tests/evidence/data/compat/, tools/megatron_fork/compat.py); and tests/README.md's map from
  each change to its tests.

``drift`` names every place that disagrees with the records; ``check`` fails on it, and
``tools/fork.py records --write`` rewrites those places. Only the standard library is used.
"""

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from . import EXIT_USAGE, ForkError, compat
from . import series as series_mod

CHANGES_FILE = "changes.toml"
UPSTREAM_URL = "https://github.com/NVIDIA/Megatron-LM"
FORK_AUTHOR = "megatron-fork <megatron-fork@users.noreply.github.com>"
GROUPS = ("fork", "backports")
FORWARDED_WORDS = ("no", "not-needed")
# A change's family: what it touches, for the reader of docs/changes.md (one heading each, in
# this order).
FAMILIES = {
    "warmup": "Warmup and calibration",
    "microbatches": "Microbatches and the training loop",
    "checkpoints": "Checkpoints and resume (distributed optimizer, scheduler, param groups)",
    "moe": "MoE gradients and routing (router losses, experts, MTP, speed)",
    "statistics": "Statistics (grad norm, param norm, zero counts, logging)",
    "other": "Other",
}
# The trailers the tool writes, in this order; a patch's last paragraph holds exactly these.
TRAILER_KEYS = ("Origin", "Bug", "Forwarded", "Applied-Upstream", "Requires", "Fork-Change")
CHANGES_DOC = "docs/changes.md"
CHANGES_BEGIN = (
    "<!-- changes: generated from patches/changes.toml by `tools/fork.py records --write` -->"
)
CHANGES_END = "<!-- /changes -->"
COUNT_BEGIN = (
    "<!-- change-count: generated from patches/changes.toml by `tools/fork.py records --write` -->"
)
COUNT_END = "<!-- /change-count -->"
TESTS_BEGIN = (
    "<!-- change-tests: generated from patches/changes.toml by `tools/fork.py records --write` -->"
)
TESTS_END = "<!-- /change-tests -->"

_KEYS = {
    "number": int,
    "group": str,
    "subject": str,
    "summary": str,
    "family": str,
    "author": str,
    "upstream_commit": str,
    "forwarded": (str, int, list),
    "note": str,
    "applied": dict,
    "bugs": list,
    "requires": list,
    "tests": list,
    "docs": list,
    "bases": dict,
}
_REQUIRED = ("number", "group", "subject", "summary", "family", "forwarded", "tests", "bases")
_SHA = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class Change:
    """One change record.

    Args:
        slug: its one name (``Fork-Change:`` trailer, file name after the number).
        number: the order of application, the same on every base.
        group: ``fork`` (the fork's own) or ``backports`` (an upstream commit carried).
        subject: the patch's subject line.
        summary: what it fixes, for users (its row in docs/changes.md).
        family: what it touches, a key of :data:`FAMILIES` (its heading in docs/changes.md).
        forwarded: DEP-3 ``Forwarded``: ``"no"``, ``"not-needed"`` or upstream PR numbers.
        note: a few words on the upstream state the fields cannot say.
        applied: where upstream has the change: ``{ref, commit?, pr?}``.
        author: a backport's upstream author (``Name <email>``).
        upstream_commit: a backport's upstream commit.
        bugs: upstream issue numbers.
        requires: slugs of changes it needs (earlier in the series or upstream on the base).
        tests: the tests that pin it (paths in this repository).
        docs: the documents that explain it.
        bases: per base, ``"carried"`` or an upstream record ``{commit, pr?, ref?}``.
    """

    slug: str
    number: int
    group: str
    subject: str
    summary: str
    forwarded: object
    family: str = ""
    note: str = ""
    applied: dict = field(default_factory=dict)
    author: str = ""
    upstream_commit: str = ""
    bugs: list = field(default_factory=list)
    requires: list = field(default_factory=list)
    tests: list = field(default_factory=list)
    docs: list = field(default_factory=list)
    bases: dict = field(default_factory=dict)

    @property
    def prs(self):
        """The upstream PR numbers of ``forwarded`` (empty for ``no``/``not-needed``)."""
        fwd = self.forwarded
        return [fwd] if isinstance(fwd, int) else list(fwd) if isinstance(fwd, list) else []


def _fail(where, what):
    raise ForkError(f"patches/{CHANGES_FILE}: {where}: {what}", EXIT_USAGE)


def parse(table, maintained=None):
    """Return {slug: Change} from the ``changes`` table, failing on the first bad field.

    Args:
        table: the parsed ``[changes]`` table.
        maintained: the maintained bases; a base outside them is refused (None: not checked).
    """
    changes, numbers = {}, {}
    for slug, raw in table.items():
        if not re.match(r"^[a-z0-9][a-z0-9-]*$", slug):
            _fail(slug, "a slug is lower-case letters, digits and '-'")
        for key, value in raw.items():
            if key not in _KEYS:
                _fail(slug, f"unknown key {key!r} (known: {', '.join(_KEYS)})")
            if not isinstance(value, _KEYS[key]):
                _fail(slug, f"{key} has the wrong type ({type(value).__name__})")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            hint = f" (family: one of {', '.join(FAMILIES)})" if "family" in missing else ""
            _fail(slug, f"missing {', '.join(missing)}{hint}")
        change = Change(slug=slug, **raw)
        if change.group not in GROUPS:
            _fail(slug, f"group {change.group!r} is not one of {', '.join(GROUPS)}")
        if change.family not in FAMILIES:
            _fail(slug, f"family {change.family!r} is not one of {', '.join(FAMILIES)}")
        fwd = change.forwarded
        if isinstance(fwd, str) and fwd not in FORWARDED_WORDS:
            _fail(slug, f"forwarded {fwd!r}: use no, not-needed or upstream PR numbers")
        if isinstance(fwd, list) and not all(isinstance(n, int) for n in fwd):
            _fail(slug, "forwarded: a list holds upstream PR numbers")
        if change.group == "backports":
            if not _SHA.match(change.upstream_commit) or "<" not in change.author:
                _fail(slug, "a backport needs upstream_commit (40 hex) and author (Name <email>)")
            if fwd != "not-needed":
                _fail(slug, "a backport's forwarded is not-needed (it came from upstream)")
        if change.applied and "ref" not in change.applied:
            _fail(slug, "applied needs ref (and commit or pr)")
        if change.number in numbers:
            _fail(slug, f"number {change.number} is also {numbers[change.number]}'s")
        numbers[change.number] = slug
        for base, state in change.bases.items():
            if maintained is not None and base not in maintained:
                _fail(slug, f"base {base!r} is not maintained ({', '.join(maintained)})")
            if state != "carried" and not (isinstance(state, dict) and "commit" in state):
                _fail(slug, f"base {base}: 'carried' or an upstream record {{commit, pr, ref}}")
        changes[slug] = change
    for change in changes.values():
        unknown = [r for r in change.requires if r not in changes]
        if unknown:
            _fail(change.slug, f"requires {', '.join(unknown)}, which is not a change")
    return dict(sorted(changes.items(), key=lambda kv: kv[1].number))


def load(patch_root, maintained=None):
    """Return the records of ``patch_root/changes.toml`` ({} when the file does not exist)."""
    path = Path(patch_root) / CHANGES_FILE
    if not path.is_file():
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ForkError(f"cannot read {path}: {exc}", EXIT_USAGE) from exc
    return parse(data.get("changes", {}), maintained)


def upstream_record(changes, slug, base):
    """Return change ``slug``'s upstream record on ``base`` (a dict: commit, pr?, ref?), or None
    where the base carries it, cannot take it, or ``changes`` has no such change."""
    change = changes.get(slug)
    state = change.bases.get(base) if change is not None else None
    return state if isinstance(state, dict) else None


def describe_upstream(record):
    """One line naming the upstream commit (and PR) of an upstream record."""
    text = f"upstream commit {record['commit'][:10]}"
    if record.get("pr"):
        text += f" (PR {record['pr']})"
    if record.get("ref"):
        text += f" in {record['ref']}"
    return text


def trailers(change):
    """Return the trailer lines of ``change``'s patches (the same on every base)."""
    lines = []
    if change.group == "backports":
        lines.append(f"Origin: upstream, {UPSTREAM_URL}/commit/{change.upstream_commit}")
    lines += [f"Bug: {UPSTREAM_URL}/issues/{n}" for n in change.bugs]
    prs = change.prs
    fwd = " ".join(f"{UPSTREAM_URL}/pull/{n}" for n in prs) if prs else change.forwarded
    lines.append(f"Forwarded: {fwd}" + (f" ({change.note})" if change.note else ""))
    if change.applied:
        app = change.applied
        where = (
            f"{UPSTREAM_URL}/commit/{app['commit']}"
            if app.get("commit")
            else f"{UPSTREAM_URL}/pull/{app['pr']}"
        )
        lines.append(f"Applied-Upstream: {app['ref']}, {where}")
    lines += [f"Requires: {slug}" for slug in change.requires]
    lines.append(f"Fork-Change: {change.slug}")
    return lines


def _is_trailer_paragraph(lines):
    """True when ``lines`` (a paragraph) is a trailer block: its first line is a known trailer
    (a wrapped value may continue on the next lines)."""
    return bool(lines) and lines[0].split(":", 1)[0] in TRAILER_KEYS


def render_patch(text, change):
    """Return the patch ``text`` with the author, opening line and trailers of ``change``.

    The message's last paragraph, when it starts with a known trailer, is replaced by
    :func:`trailers`; otherwise the trailers are appended as a new paragraph. A backport's
    message opens with ``commit <sha> upstream.`` and its ``From:`` names the upstream author;
    every other patch's ``From:`` is the fork.
    """
    head, sep, rest = text.partition("\n---\n")
    if not sep:
        head, sep, rest = text.partition("\ndiff --git ")
    lines = head.split("\n")
    author = change.author if change.group == "backports" else FORK_AUTHOR
    lines = [
        f"From: {author}" if ln.startswith("From: ") and i < 3 else ln for i, ln in enumerate(lines)
    ]
    subj = next(i for i, ln in enumerate(lines) if ln.startswith("Subject: "))
    body_start = next(i for i in range(subj + 1, len(lines)) if not lines[i].startswith(" ")) + 1
    body = lines[body_start:]
    while body and body[-1] == "":
        body.pop()
    cut = max((i for i, ln in enumerate(body) if ln == ""), default=-1) + 1
    if cut > 0 and _is_trailer_paragraph(body[cut:]):
        body = body[: cut - 1]
    opening = re.compile(r"^commit [0-9a-f]{40} upstream\.$")
    if body and opening.match(body[0]):
        body = body[2:] if len(body) > 1 and body[1] == "" else body[1:]
    if change.group == "backports":
        body = [f"commit {change.upstream_commit} upstream.", ""] + body
    message = lines[:body_start] + body + [""] + trailers(change)
    return "\n".join(message) + sep + rest


def _base_cell(change, base):
    state = change.bases.get(base)
    if state is None:
        return "not applicable"
    if state == "carried":
        return "carried"
    pr = f" (PR {state['pr']})" if state.get("pr") else ""
    return f"upstream `{state['commit'][:10]}`{pr}"


def upstream_words(change):
    """The upstream column of ``change``'s row in docs/changes.md."""
    if change.group == "backports":
        words = f"backport of `{change.upstream_commit[:10]}`"
        if change.applied:
            pr = f", PR {change.applied['pr']}" if change.applied.get("pr") else ""
            words += f" ({change.applied['ref']}{pr})"
    elif change.prs:
        words = "upstream PR " + ", ".join(str(n) for n in change.prs)
    else:
        words = "not forwarded"
    if change.group != "backports" and change.applied:
        words += f"; applied on {change.applied['ref']}"
    if change.bugs:
        words += "; issue " + ", ".join(str(n) for n in change.bugs)
    if change.note:
        words += f"; {change.note}"
    return words


def changes_table(changes, bases):
    """docs/changes.md's change table (markdown lines, markers excluded): a heading per family
    that has changes, in :data:`FAMILIES` order, over its changes in number order."""
    lines = []
    for family, heading in FAMILIES.items():
        members = [c for c in changes.values() if c.family == family]
        if not members:
            continue
        if lines:
            lines.append("")
        lines += [
            f"## {heading}",
            "",
            "| change | what it fixes | upstream | " + " | ".join(bases) + " |",
            "|---|---|---|" + "---|" * len(bases),
        ]
        for c in sorted(members, key=lambda c: c.number):
            cells = [f"{c.number:04d} `{c.slug}`", c.summary, upstream_words(c)]
            cells += [_base_cell(c, b) for b in bases]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def count_line(changes):
    """The README's line between the change-count markers: how many changes, and where the
    table is."""
    return [
        f"{len(changes)} changes, by family, with where each stands upstream and on each base:"
        f" `{CHANGES_DOC}`."
    ]


def tests_table(changes):
    """tests/README.md's map from each change to its tests (markdown lines, markers excluded)."""
    lines = ["| change | its tests |", "|---|---|"]
    for c in changes.values():
        tests = ", ".join(f"`{path}`" for path in c.tests)
        lines.append(f"| {c.number:04d} `{c.slug}` | {tests} |")
    return lines


def _replace_block(text, begin, end, lines, where):
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ForkError(f"{where} needs exactly one {begin} and one {end} line", EXIT_USAGE)
    before, rest = text.split(begin + "\n", 1)
    _, after = rest.split(end, 1)
    return before + begin + "\n" + "\n".join(lines) + "\n" + end + after


@dataclass
class Plan:
    """What the records generate: {path: wanted text} for every generated file."""

    files: dict

    def drift(self):
        """Paths (relative to the root) whose text differs from the wanted one."""
        return [p for p, (have, want) in self.files.items() if have != want]


def plan(patch_root, pin):
    """Return the Plan of a ``patches/`` folder: every patch of every maintained base, and
    docs/changes.md, the README and tests/README.md beside ``patches/`` (each where it exists).
    Paths are relative to the folder above ``patches/``."""
    patch_root = Path(patch_root)
    changes = load(patch_root, pin["maintained"])
    files = {}
    if not changes:
        return Plan(files)
    doc = patch_root.parent / CHANGES_DOC
    if doc.is_file():
        have = doc.read_text()
        table = changes_table(changes, list(pin["maintained"]))
        files[CHANGES_DOC] = (
            have,
            _replace_block(have, CHANGES_BEGIN, CHANGES_END, table, CHANGES_DOC),
        )
    readme = patch_root.parent / "README.md"
    if readme.is_file():
        have = readme.read_text()
        want = _replace_block(have, COUNT_BEGIN, COUNT_END, count_line(changes), "README.md")
        if compat.BEGIN in want:
            matrix = compat.matrix_lines(patch_root.parent, pin["maintained"])
            want = _replace_block(want, compat.BEGIN, compat.END, matrix, "README.md")
        files["README.md"] = (have, want)
    tests_readme = patch_root.parent / "tests" / "README.md"
    if tests_readme.is_file():
        have = tests_readme.read_text()
        want = _replace_block(have, TESTS_BEGIN, TESTS_END, tests_table(changes), "tests/README.md")
        files["tests/README.md"] = (have, want)
    for base in pin["maintained"]:
        patch_dir = patch_root / base
        if not (patch_dir / "series").is_file():
            continue
        for entry in series_mod.read_series(patch_dir):
            path = patch_dir / entry
            if not path.is_file():
                continue
            have = path.read_text()
            slug = re.search(r"(?m)^Fork-Change: (\S+)", have.split("\ndiff --git ", 1)[0])
            if slug is None or slug.group(1) not in changes:
                continue  # check names a patch without a record
            files[f"patches/{base}/{entry}"] = (have, render_patch(have, changes[slug.group(1)]))
    return Plan(files)


def write(patch_root, pin):
    """Rewrite every generated file that drifted; return the paths written."""
    p = plan(patch_root, pin)
    written = p.drift()
    for rel in written:
        (Path(patch_root).parent / rel).write_text(p.files[rel][1])
    return written


def counterfactual_files(changes):
    """The counterfactual test files of all changes (``tests/test_*.py``, each once, in change
    order): the files whose arms run pristine and fork, which ``tools/test.sh`` runs on every
    maintained base, the other releases under a second ``ATEN_CPU_CAPABILITY``."""
    files = []
    for change in changes.values():
        for path in change.tests:
            if re.match(r"^tests/test_\w+\.py$", path) and path not in files:
                files.append(path)
    return files


def render_rendered(rendered, changes):
    """Apply :func:`render_patch` to {entry: patch text} (``export``'s output)."""
    out = {}
    for entry, text in rendered.items():
        slug = re.search(r"(?m)^Fork-Change: (\S+)", text.split("\ndiff --git ", 1)[0])
        change = changes.get(slug.group(1)) if slug else None
        out[entry] = render_patch(text, change) if change else text
    return out
