"""The patch series: reading patches/series, patch metadata, and dry-run classification."""

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import EXIT_APPLY, EXIT_USAGE, ForkError
from .upstream import REPO

PATCH_DIR = REPO / "patches"
SERIES_FILE = PATCH_DIR / "series"

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
        name: file name inside patches/.
        path: full path of the file.
        subject: the subject line without the ``[PATCH]`` prefix.
        upstream_status: the ``Upstream-Status:`` trailer.
        requires: the ``Requires:`` trailers (file names of earlier patches).
        upstream_commits: the ``Upstream-Commit:`` trailers (Megatron-LM commits with the change).
        files: the paths the patch touches.
    """

    name: str
    path: Path
    subject: str = ""
    upstream_status: str = ""
    requires: list = field(default_factory=list)
    upstream_commits: list = field(default_factory=list)
    files: list = field(default_factory=list)


def read_series(patch_dir=PATCH_DIR):
    """Return the patch file names listed in ``patch_dir/series``, in order.

    Blank lines and ``#`` comments are ignored. Fails on duplicates and on names with a path.
    """
    series = Path(patch_dir) / "series"
    if not series.is_file():
        raise ForkError(f"{series} does not exist", EXIT_USAGE)
    names = []
    for lineno, line in enumerate(series.read_text().splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if "/" in entry or not entry.endswith(".patch"):
            raise ForkError(f"{series}:{lineno}: {entry!r} is not a patch file name", EXIT_USAGE)
        if entry in names:
            raise ForkError(f"{series}:{lineno}: {entry} is listed twice", EXIT_USAGE)
        names.append(entry)
    return names


def series_mismatch(patch_dir=PATCH_DIR):
    """Return (names in series without a file, patch files not in the series)."""
    names = read_series(patch_dir)
    on_disk = sorted(p.name for p in Path(patch_dir).glob("*.patch"))
    missing = [n for n in names if not (Path(patch_dir) / n).is_file()]
    extra = [n for n in on_disk if n not in names]
    return missing, extra


def parse_patch(path):
    """Parse a git format-patch file, failing clearly when it is corrupt or truncated."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ForkError(f"patch {path.name}: cannot read it: {exc}", EXIT_APPLY) from exc
    patch = Patch(name=path.name, path=path)
    subject = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n .*)*)", text, re.M)
    if not text.startswith("From ") or not subject or "\ndiff --git " not in text:
        raise ForkError(
            f"patch {path.name}: not a git format-patch file (needs a From line, a Subject "
            "and at least one 'diff --git' section)",
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
    status = re.search(r"^Upstream-Status: (.+)$", header, re.M)
    patch.upstream_status = status.group(1).strip() if status else ""
    patch.requires = re.findall(r"^Requires: (\S+)", header, re.M)
    patch.upstream_commits = re.findall(r"^Upstream-Commit: ([0-9a-f]{7,40})", header, re.M)
    patch.files = re.findall(r"^\+\+\+ b/(\S+)", text, re.M) + re.findall(
        r"^--- a/(\S+)\n\+\+\+ /dev/null", text, re.M
    )
    _check_hunks(patch, text)
    return patch


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
                raise ForkError(f"patch {patch.name}: truncated inside hunk {header!r}", EXIT_APPLY)
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
                    f"patch {patch.name}: corrupt hunk {header!r}: unexpected line {line[:60]!r}",
                    EXIT_APPLY,
                )
            i += 1
        if old < 0 or new < 0:
            raise ForkError(f"patch {patch.name}: corrupt hunk {header!r}: bad counts", EXIT_APPLY)


def load_series(patch_dir=PATCH_DIR):
    """Return the parsed patches in series order, failing on a name without a file."""
    patches = []
    for name in read_series(patch_dir):
        path = Path(patch_dir) / name
        if not path.is_file():
            raise ForkError(f"patches/series lists {name}, but {path} does not exist", EXIT_USAGE)
        patches.append(parse_patch(path))
    return patches


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
    current, failures = "?", []
    for line in output.splitlines():
        m = re.match(r"^(?:checking|patching) file (.+)$", line)
        if m:
            current = m.group(1)
        m = re.match(r"^Hunk #(\d+) FAILED at (\d+)", line)
        if m:
            failures.append(
                f"{patch.name}: file {current}: hunk #{m.group(1)} FAILED at line {m.group(2)}"
            )
        if "can't find file" in line or "No file to patch" in line:
            failures.append(f"{patch.name}: file {current}: does not exist in the tree")
        if "Only garbage" in line or "malformed patch" in line:
            failures.append(f"{patch.name}: malformed patch ({line.strip()})")
        if re.search(r"already exists|previously applied", line):
            failures.append(f"{patch.name}: file {current}: {line.strip()}")
    return failures or [f"{patch.name}: {output.strip()[-300:]}"]


def classify(patch, tree):
    """Classify how ``patch`` relates to ``tree`` without changing it.

    Returns:
        (outcome, detail): outcome is one of OUTCOMES. ``upstream`` means the patch
        reverse-applies cleanly, i.e. the tree already contains the change.
    """
    rc, out = gnu_patch(patch.path, tree, reverse=True)
    if rc == 0 and "fuzz" not in out:
        return UPSTREAM, "reverse-applies cleanly: the base already contains this change"
    rc, out = gnu_patch(patch.path, tree)
    if rc == 0:
        offsets = [line.strip() for line in out.splitlines() if "offset" in line]
        if offsets:
            return OFFSET, "; ".join(offsets)
        return CLEAN, ""
    rc3, out3 = gnu_patch(patch.path, tree, fuzz=3)
    if rc3 == 0:
        return FUZZ, "; ".join(line.strip() for line in out3.splitlines() if "fuzz" in line)
    return CONFLICT, "; ".join(describe_failure(patch, out))


def apply_strict(patch, tree):
    """Apply ``patch`` with zero fuzz and zero offset, or fail naming patch, file and hunk."""
    outcome, detail = classify(patch, tree)
    if outcome != CLEAN:
        what = {
            UPSTREAM: "is already contained in the base",
            OFFSET: "applies only with an offset",
            FUZZ: "applies only with fuzz",
            CONFLICT: "does not apply",
        }[outcome]
        raise ForkError(f"patch {patch.name} {what}: {detail}", EXIT_APPLY)
    rc, out = gnu_patch(patch.path, tree, dry_run=False)
    if rc != 0:
        raise ForkError("; ".join(describe_failure(patch, out)), EXIT_APPLY)
