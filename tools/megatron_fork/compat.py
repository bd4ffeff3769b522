"""The compatibility matrix: what each fork wheel was checked with, from the checks' own records.

Two sources, both under ``tests/evidence/data/compat/``:

- ``torch-<base>-<torch>.json``, one per run of ``tools/compat.py torch``: the fork wheel of one
  base installed into a venv holding one torch release, ``megatron-fork-verify --import``, and
  the base's counterfactual test files (pristine and fork arms) under that torch, with pytest's
  counts;
- ``clients.toml``: what the downstream checks found (Megatron-Bridge, ms-swift, Transformer
  Engine, the container images), each with the document or evidence that holds the run.

:func:`matrix_lines` renders the README's table from them; ``tools/fork.py records`` checks the
README against it and ``records --write`` rewrites it.
"""

import json
import tomllib
from pathlib import Path

DATA = "tests/evidence/data/compat"
BEGIN = (
    "<!-- compat-matrix: generated from tests/evidence/data/compat/ by"
    " `tools/fork.py records --write` -->"
)
END = "<!-- /compat-matrix -->"


def _version_key(text):
    return tuple(int(p) if p.isdigit() else p for p in text.replace("+", ".").split("."))


def torch_runs(root):
    """{base: [run record, ...]} of the torch checks, oldest torch first."""
    runs = {}
    for path in sorted((Path(root) / DATA).glob("torch-*.json")):
        record = json.loads(path.read_text())
        runs.setdefault(record["base"], []).append(record)
    for records in runs.values():
        records.sort(key=lambda r: _version_key(r["torch"]))
    return runs


def _torch_cell(record):
    if record["failed"] or record["errors"] or record["pytest_exit"] or record["verify"] != "ok":
        failed, status = record["failed"], record["pytest_exit"]
        return f"{record['torch']} FAILED ({failed} failed, pytest exit {status})"
    return f"{record['torch']} ({record['passed']} passed)"


def matrix_lines(root, maintained):
    """The README's table (markdown lines), one row per maintained base with a record."""
    root = Path(root)
    clients = tomllib.loads((root / DATA / "clients.toml").read_text())
    runs = torch_runs(root)
    lines = [
        "| fork wheel | torch checked (counterfactual tests) | Megatron-Bridge | ms-swift "
        "| Transformer Engine | containers |",
        "|---|---|---|---|---|---|",
    ]
    for base in maintained:
        per_base = clients.get("bases", {}).get(base)
        if per_base is None and base not in runs:
            continue
        per_base = per_base or {}
        versions = sorted({r["fork_version"] for r in runs.get(base, [])}, key=_version_key)
        wheel = f"`{versions[-1]}`" if versions else f"`{base}` (from a clone)"
        checked = "; ".join(_torch_cell(r) for r in runs.get(base, [])) or "not run"
        cells = [
            wheel,
            checked,
            per_base.get("megatron_bridge", "not checked"),
            per_base.get("ms_swift", "not checked"),
            per_base.get("transformer_engine", clients["transformer_engine"]),
            per_base.get("containers", clients["containers"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
