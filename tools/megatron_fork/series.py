"""The patch series of each base: patches/<base>/series, patch metadata, dry-run classification.

Layout: ``patches/<base>/series`` lists the base's carried patches as ``<group>/<file>.patch``,
where the group says where the change comes from (``fork``: the fork's own change;
``backports``: a change upstream made on another line, carried here). ``patches/changes.toml``
is the catalogue of changes across bases: which bases carry each one, and which already contain
it upstream (with the upstream commit and PR). A patch names its change with a ``Fork-Change:``
trailer, so the same change is recognizable on every base.
"""

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import EXIT_APPLY, EXIT_USAGE, ForkError

GROUPS = ("fork", "backports")

CLEAN = "clean"
OFFSET = "offset"
FUZZ = "fuzz"
CONFLICT = "conflict"
UPSTREAM = "upstream"
OUTCOMES = (CLEAN, OFFSET, FUZZ, CONFLICT, UPSTREAM)


@dataclass
class Patch:
    """One patch of the series with its parsed metadata.

    Args:
        name: the series entry, ``<group>/<file>.patch`` (or a bare file name).
        path: full path of the file.
        subject: the subject line without the ``[PATCH]`` prefix.
        forwarded: the ``Forwarded:`` trailer (DEP-3: ``no``, ``not-needed`` or PR URLs).
        requires: the ``Requires:`` trailers (slugs of changes it needs).
        upstream_commits: the commits of the ``Origin: upstream, <url>/commit/<sha>`` trailers.
        files: the paths the patch touches.
        change: the ``Fork-Change:`` trailer (the change's slug, the same on every base).
    """

    name: str
    path: Path
    subject: str = ""
    forwarded: str = ""
    requires: list = field(default_factory=list)
    upstream_commits: list = field(default_factory=list)
    files: list = field(default_factory=list)
    change: str = ""

    @property
    def where(self):
        """``patches/<base>/<entry>``: the series entry alone exists on every base."""
        return _where(self.path, self.name)

    @property
    def basename(self):
        """The file name without the group directory."""
        return self.name.rsplit("/", 1)[-1]


def _where(path, entry=None):
    """Name a patch file with its series directory, e.g. ``patches/0.19.2/fork/0007-x.patch``."""
    depth = (entry or Path(path).name).count("/") + 1
    return "/".join(Path(path).parts[-(depth + 2) :])


def read_series(patch_dir):
    """Return the patch entries listed in ``patch_dir/series``, in order.

    Blank lines and ``#`` comments are ignored. An entry is ``<group>/<file>.patch`` or a bare
    ``<file>.patch``. Fails on duplicates and on deeper paths.
    """
    series = Path(patch_dir) / "series"
    if not series.is_file():
        raise ForkError(f"{series} does not exist", EXIT_USAGE)
    names = []
    for lineno, line in enumerate(series.read_text().splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        parts = entry.split("/")
        if len(parts) > 2 or not entry.endswith(".patch") or ".." in parts or "" in parts:
            raise ForkError(f"{series}:{lineno}: {entry!r} is not a patch file name", EXIT_USAGE)
        if entry in names:
            raise ForkError(f"{series}:{lineno}: {entry} is listed twice", EXIT_USAGE)
        names.append(entry)
    return names


def patch_files(patch_dir):
    """Return the series-relative paths of every patch file under ``patch_dir``."""
    return sorted(p.relative_to(patch_dir).as_posix() for p in Path(patch_dir).rglob("*.patch"))


def series_mismatch(patch_dir):
    """Return (names in series without a file, patch files not in the series)."""
    names = read_series(patch_dir)
    on_disk = patch_files(patch_dir)
    missing = [n for n in names if not (Path(patch_dir) / n).is_file()]
    extra = [n for n in on_disk if n not in names]
    return missing, extra


def parse_patch(path, entry=None):
    """Parse a git format-patch file, failing clearly when it is corrupt or truncated.

    Args:
        path: the patch file.
        entry: its series entry (default: the file name).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ForkError(f"patch {_where(path, entry)}: cannot read it: {exc}", EXIT_APPLY) from exc
    patch = Patch(name=entry or path.name, path=path)
    subject = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n .*)*)", text, re.M)
    if not text.startswith("From ") or not subject or "\ndiff --git " not in text:
        raise ForkError(
            f"patch {_where(path, entry)}: not a git format-patch file (needs a From line, a "
            "Subject and at least one 'diff --git' section)",
            EXIT_APPLY,
        )
    patch.subject = " ".join(subject.group(1).split())
    lines = text.split("\n")
    first = next((i for i, line in enumerate(lines) if line == "---"), None)
    if first is not None and not re.match(r"^( \S.*\| |diff --git )", lines[first + 1]):
        raise ForkError(
            f"patch {path.name}: line {first + 1} of its message is '---', which git am takes as "
            "the end of the message (the rest of the description would be lost); use 'Fix:' "
            "style headings instead of underlines",
            EXIT_APPLY,
        )
    header = text.split("\ndiff --git ", 1)[0]
    forwarded = re.search(r"^Forwarded: (.+)$", header, re.M)
    patch.forwarded = forwarded.group(1).strip() if forwarded else ""
    patch.requires = re.findall(r"^Requires: (\S+)", header, re.M)
    patch.upstream_commits = re.findall(
        r"^Origin: upstream, \S*/commit/([0-9a-f]{7,40})", header, re.M
    )
    change = re.search(r"^Fork-Change: (\S+)", header, re.M)
    patch.change = change.group(1) if change else ""
    patch.files = re.findall(r"^\+\+\+ b/(\S+)", text, re.M) + re.findall(
        r"^--- a/(\S+)\n\+\+\+ /dev/null", text, re.M
    )
    _check_hunks(patch, text)
    _check_complete(patch, text)
    return patch


def _check_complete(patch, text):
    """Fail when the diff lacks files or lines its diffstat announces (cut at a file boundary).

    A patch cut right after a complete hunk has consistent hunks; only the diffstat that
    ``git format-patch`` writes above the diff still knows what was lost.
    """
    if "\n---\n" not in text.split("\ndiff --git ", 1)[0] + "\n":
        return
    stat_block = text.split("\ndiff --git ", 1)[0].rsplit("\n---\n", 1)[-1]
    summary = re.search(
        r"^ (\d+) files? changed(?:, (\d+) insertions?\(\+\))?(?:, (\d+) deletions?\(-\))?",
        stat_block,
        re.M,
    )
    if not summary:
        return
    n_files = int(summary.group(1))
    sections = re.findall(r"^diff --git a/(\S+) b/(\S+)", text, re.M)
    body = text.split("\ndiff --git ", 1)[1]
    plus = len(re.findall(r"^\+(?!\+\+ )", body, re.M))
    minus = len(re.findall(r"^-(?!-- )", body, re.M))
    want_plus, want_minus = int(summary.group(2) or 0), int(summary.group(3) or 0)
    if len(sections) != n_files or (plus, minus) != (want_plus, want_minus):
        stated = re.findall(r"^ (\S+)\s+\|", stat_block, re.M)
        present = {b for _, b in sections} | {a for a, _ in sections}
        lost = [f for f in stated if f not in present and not f.startswith("...")]
        raise ForkError(
            f"patch {patch.where}: incomplete diff: its diffstat announces {n_files} files "
            f"(+{want_plus}/-{want_minus} lines), the diff has {len(sections)} (+{plus}/-{minus})"
            + (f"; missing: {', '.join(lost)}" if lost else "")
            + " (truncated or hand-edited; regenerate it with tools/fork.py export)",
            EXIT_APPLY,
        )


def _check_hunks(patch, text):
    """Fail when a hunk's line counts disagree with its body (a truncated or hand-edited patch)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", lines[i])
        if not m:
            i += 1
            continue
        old = int(m.group(1) if m.group(1) is not None else 1)
        new = int(m.group(2) if m.group(2) is not None else 1)
        header, i = lines[i], i + 1
        while old > 0 or new > 0:
            if i >= len(lines):
                raise ForkError(
                    f"patch {patch.where}: truncated inside hunk {header!r}", EXIT_APPLY
                )
            line = lines[i]
            if line.startswith("\\"):
                i += 1
                continue
            tag = line[:1]
            if tag == " " or line == "":
                old, new = old - 1, new - 1
            elif tag == "-":
                old -= 1
            elif tag == "+":
                new -= 1
            else:
                raise ForkError(
                    f"patch {patch.where}: corrupt hunk {header!r}: unexpected line {line[:60]!r}",
                    EXIT_APPLY,
                )
            i += 1
        if old < 0 or new < 0:
            raise ForkError(f"patch {patch.where}: corrupt hunk {header!r}: bad counts", EXIT_APPLY)


def load_series(patch_dir):
    """Return the parsed patches in series order, failing on a name without a file."""
    patches = []
    for name in read_series(patch_dir):
        path = Path(patch_dir) / name
        if not path.is_file():
            raise ForkError(
                f"{patch_dir}/series lists {name}, but {path} does not exist", EXIT_USAGE
            )
        patches.append(parse_patch(path, name))
    return patches


def series_digest(patches):
    """Return the sha256 of a series: its entries and their bytes, in order.

    It changes whenever the carried series changes (a patch added, removed, reordered or edited)
    and is the hex part of the install's local version label.
    """
    import hashlib  # pylint: disable=import-outside-toplevel

    digest = hashlib.sha256()
    for patch in patches:
        digest.update(f"{patch.name}\n".encode())
        digest.update(patch.path.read_bytes())
    return digest.hexdigest()


def gnu_patch(patch_path, tree, reverse=False, fuzz=0, dry_run=True):
    """Run GNU patch on ``tree`` and return (returncode, output)."""
    cmd = ["patch", "-p1", "-f", f"--fuzz={fuzz}", "--no-backup-if-mismatch", "-r", "-"]
    if reverse:
        cmd.append("-R")
    if dry_run:
        cmd.append("--dry-run")
    with open(patch_path, "rb") as f:
        proc = subprocess.run(cmd, cwd=tree, stdin=f, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def describe_failure(patch, output):
    """Turn GNU patch output into 'file X: hunk #N FAILED at L' lines."""
    current, failures, missing = "?", [], None
    for line in output.splitlines():
        m = re.match(r"^(?:checking|patching) file (.+)$", line)
        if m:
            current = m.group(1)
        m = re.match(r"^Hunk #(\d+) FAILED at (\d+)", line)
        if m:
            failures.append(
                f"{patch.name}: file {current}: hunk #{m.group(1)} FAILED at line {m.group(2)}"
            )
        # A missing file is named only in the quoted diff header ("|--- a/F", "|+++ b/F") that
        # GNU patch prints between "can't find file to patch" and "No file to patch".
        if "can't find file" in line:
            missing = "?"
        m = re.match(r"^\|(?:---|\+\+\+) [ab]/(\S+)", line)
        if m and missing is not None:
            missing = m.group(1)
        if "No file to patch" in line:
            where = missing or current
            failures.append(f"{patch.name}: file {where}: does not exist in the tree")
            missing = None
        if "Only garbage" in line or "malformed patch" in line:
            failures.append(f"{patch.name}: malformed patch ({line.strip()})")
        if re.search(r"already exists|previously applied", line):
            failures.append(f"{patch.name}: file {current}: {line.strip()}")
    return failures or [f"{patch.name}: {output.strip()[-300:]}"]


def describe_hunks(patch, output, what):
    """Return 'patch: file X: hunk #N ...' for each hunk line of GNU patch output naming ``what``.

    Args:
        patch: the patch.
        output: GNU patch's output.
        what: "offset" or "fuzz".
    """
    current, found = "?", []
    for line in output.splitlines():
        m = re.match(r"^(?:checking|patching) file (.+)$", line)
        if m:
            current = m.group(1)
        m = re.match(r"^Hunk #(\d+) succeeded at (\d+)(.*)$", line)
        if m and what in m.group(3):
            found.append(
                f"{patch.name}: file {current}: hunk #{m.group(1)} at line {m.group(2)}"
                f"{m.group(3).rstrip('.')}"
            )
    return "; ".join(found)


def _hunks_with(output, what):
    """True when a 'Hunk #N succeeded at L ...' line of GNU patch output mentions ``what``.

    Only hunk lines count: a file name such as test_softmax_offset_tp_attributes.py in a
    'checking file' line is no offset.
    """
    return any(
        re.match(r"^Hunk #\d+ succeeded at \d+", line) and what in line
        for line in output.splitlines()
    )


def classify(patch, tree):
    """Classify how ``patch`` relates to ``tree`` without changing it.

    Returns:
        (outcome, detail): outcome is one of OUTCOMES. ``upstream`` means the patch
        reverse-applies cleanly, i.e. the tree already contains the change.
    """
    rc, out = gnu_patch(patch.path, tree, reverse=True)
    if rc == 0 and not _hunks_with(out, "fuzz"):
        return UPSTREAM, "reverse-applies cleanly: the base already contains this change"
    rc, out = gnu_patch(patch.path, tree)
    if rc == 0:
        if _hunks_with(out, "offset"):
            return OFFSET, describe_hunks(patch, out, "offset")
        return CLEAN, ""
    rc3, out3 = gnu_patch(patch.path, tree, fuzz=3)
    if rc3 == 0:
        return FUZZ, describe_hunks(patch, out3, "fuzz")
    return CONFLICT, "; ".join(describe_failure(patch, out))
