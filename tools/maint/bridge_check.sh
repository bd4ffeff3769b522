#!/usr/bin/env bash
# Megatron-Bridge as a downstream client of the fork (docs/megatron-bridge.md).
#
#   tools/maint/bridge_check.sh --mirror BRIDGE_GIT_DIR [--bridge 0.6.0] [--ref v0.6.0]
#       [--base 0.19.2] [--root DIR] [--src DIR]
#       [--envs "fork pristine"] [--steps "env deps check tests verify compare"]
#       [--timeout 300] [--pytest-args "..."] [--te-stub] [--paths "tests/unit_tests/..."]
#
# For each env (fork: tools/install.sh; pristine: PyPI megatron-core==BASE), both with
# torch==2.13.0 held by a constraints file: install megatron-bridge --no-deps, then each of
# its requirements (and megatron-core's [dev,mlm] extras) one pip call at a time, recording
# what installed and what did not; pip check; import (as is and with the TE stub below);
# Bridge's tests/unit_tests from the mirror's REF (git archive into --src, outside this repo),
# as they are and, with --te-stub, with an inert transformer_engine stub (Bridge imports
# transformer_engine.pytorch unconditionally; the stub goes in only after megatron.core was
# imported without TE);
# megatron-fork-verify --import in the fork env; a per-test comparison of the two junit files.
# Results go to ROOT/results/.
# Defaults: ROOT = ${XDG_CACHE_HOME:-$HOME/.cache}/megatron-fork/bridge, SRC = ROOT/src-REF
# (one tree per test ref, so a new --ref never runs an older extraction). Both must lie
# outside this repository; nothing of Bridge is written inside it.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"

bridge=0.6.0 ref="" base=0.19.2 root="${XDG_CACHE_HOME:-$HOME/.cache}/megatron-fork/bridge" src="" mirror=""
paths="tests/unit_tests" envs="fork pristine" steps="env deps check tests verify compare" timeout=300 pyargs="" mode=plain
while [ $# -gt 0 ]; do
  case "$1" in
    --bridge) bridge="$2"; shift 2 ;;
    --ref) ref="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --root) root="$2"; shift 2 ;;
    --src) src="$2"; shift 2 ;;
    --mirror) mirror="$2"; shift 2 ;;
    --envs) envs="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --pytest-args) pyargs="$2"; shift 2 ;;
    --te-stub) mode=te-stub; shift ;;
    --paths) paths="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "bridge_check.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
ref="${ref:-v$bridge}"
src="${src:-$root/src-$ref}"
for d in "$root" "$src"; do
  case "$(realpath -m "$d")" in "$repo"|"$repo"/*) echo "bridge_check.sh: $d must be outside $repo" >&2; exit 2 ;; esac
done
has() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
res="$root/results"
mkdir -p "$res"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONWARNINGS=ignore

make_env() {  # $1 = fork | pristine
  local e="$1" py="$root/$1/bin/python"
  [ -x "$py" ] && "$py" -c 'import megatron.core, torch' 2>/dev/null && return 0
  if [ "$e" = fork ]; then
    nice -n 10 "$repo/tools/install.sh" --base "$base" --venv "$root/fork" || return 1
  else
    env PYENV_VERSION=3.12.1 python3.12 -m venv "$root/pristine" || return 1
    nice -n 10 "$py" -m pip install -q -c <(echo torch==2.13.0) torch==2.13.0 "megatron-core==$base"
  fi
}

# Bridge's own requirements plus megatron-core's [dev,mlm] extras (which Bridge asks for as
# megatron-core[dev,mlm]), one per line, as the installed metadata states them.
requirements() {
  "$1" - <<'EOF'
from importlib.metadata import distribution
from packaging.requirements import Requirement
seen = []
for r in distribution("megatron-bridge").requires:
    q = Requirement(r)
    if q.name in ("megatron-core", "torch") or (q.marker and not q.marker.evaluate({"extra": ""})):
        continue
    seen.append(str(q))
for r in distribution("megatron-core").requires:
    q = Requirement(r)
    if q.marker and any(q.marker.evaluate({"extra": x}) for x in ("dev", "mlm")):
        q.marker = None
        seen.append(str(q))
print("\n".join(dict.fromkeys(seen)))
EOF
}

deps() {  # $1 = env; writes install.tsv (requirement, ok|FAILED, last pip error line)
  local e="$1" py="$root/$1/bin/python" out="$res/$1" con
  mkdir -p "$out"
  # Constraints: torch==2.13.0 (no other torch ever), the installed megatron-core, and the
  # version pins of megatron-core's [dev,mlm] extras, so that a name Bridge asks for unpinned
  # (nvidia-resiliency-ext) is not resolved below core's pin (0.4.1 breaks import megatron.core).
  con="$out/constraints.txt"
  "$py" - > "$con" <<'PYEOF'
from importlib.metadata import distribution, version
from packaging.requirements import Requirement
print("torch==2.13.0")
print("megatron-core==" + version("megatron-core"))
for r in distribution("megatron-core").requires:
    q = Requirement(r)
    if q.specifier and q.marker and any(q.marker.evaluate({"extra": x}) for x in ("dev", "mlm")):
        print(f"{q.name}{q.specifier}")
PYEOF
  nice -n 10 "$py" -m pip install -q -c "$con" --no-deps "megatron-bridge==$bridge" || return 1
  : > "$out/install.tsv"
  { requirements "$py"; printf '%s\n' 'pytest>=8.3.5' 'pytest-timeout>=2.4.0' 'pytest-mock>=3.14.0' pygithub click; } |
  while IFS= read -r req; do
    if timeout 1200 nice -n 10 "$py" -m pip install -q -c "$con" "$req" > "$out/pip.log" 2>&1; then
      printf '%s\tok\t\n' "$req" >> "$out/install.tsv"
    else
      printf '%s\tFAILED\t%s\n' "$req" \
        "$(grep -E 'urlopen error|nvcc|No module named|No matching distribution|Could not build wheels|^ERROR' \
           "$out/pip.log" | sed 's/^ *//' | sort -u | head -3 | tr '\t\n' '; ')" >> "$out/install.tsv"
    fi
  done
  rm -f "$out/pip.log"
  "$py" -m pip freeze --all > "$out/freeze.txt" 2>/dev/null
  echo "== $e: $(grep -c $'\tok\t' "$out/install.tsv") requirements installed, not installed:"
  grep $'\tFAILED\t' "$out/install.tsv" || echo "   (none)"
}

check() {
  local e="$1" py="$root/$1/bin/python" out="$res/$1"
  mkdir -p "$out"
  "$py" -m pip check > "$out/pip-check.txt" 2>&1; echo "pip check rc=$?" >> "$out/pip-check.txt"
  local imp='import megatron.bridge, megatron.core as c; print("import megatron.bridge ok", megatron.bridge.__version__, "core", c.__version__)'
  (cd /tmp && "$py" -c "$imp") > "$out/import.txt" 2>&1; echo "import rc=$?" >> "$out/import.txt"
  # The same import with the TE stub of --te-stub loaded first (as pytest -p bridge_te_stub does).
  write_stub "$root/te-stub"
  (cd /tmp && PYTHONPATH="$root/te-stub" "$py" -c "import bridge_te_stub; $imp") > "$out/import-te-stub.txt" 2>&1
  echo "import rc=$?" >> "$out/import-te-stub.txt"
  echo "== $e"; tail -n 4 "$out/pip-check.txt"; tail -n 2 "$out/import.txt"; tail -n 2 "$out/import-te-stub.txt"
}

write_stub() {  # $1 = directory; a pytest plugin, written here, outside the repository
  mkdir -p "$1"
  cat > "$1/bridge_te_stub.py" <<'PYEOF'
"""Import all of megatron.core without Transformer Engine, then put an inert
transformer_engine stub into sys.modules so megatron.bridge imports on CPU."""
import importlib, importlib.machinery, pkgutil, sys, types

import megatron.core

for m in pkgutil.walk_packages(megatron.core.__path__, "megatron.core."):
    try:
        importlib.import_module(m.name)
    except Exception:
        pass


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__name__}.{name}")


def _fail(self, *a, **k):
    raise RuntimeError(f"transformer_engine stub: {type(self).__name__}")


def _stub_class(name):
    return _Meta(name, (), {"__init__": _fail})


class _Stub(types.ModuleType):
    __path__ = []

    def __init__(self, name):
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


for n in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
          "transformer_engine.common.recipe", "transformer_engine.pytorch.fp8",
          "transformer_engine.pytorch.distributed"):
    sys.modules.setdefault(n, _Stub(n))
PYEOF
}

tests() {
  local e="$1" py="$root/$1/bin/python" out="$res/$1" plug=()
  mkdir -p "$out"
  if [ ! -d "$src/tests/unit_tests" ]; then
    [ -n "$mirror" ] || { echo "bridge_check.sh: --mirror needed to extract $ref" >&2; return 2; }
    git --git-dir="$mirror" rev-parse -q --verify "$ref^{commit}" > /dev/null ||
      { echo "bridge_check.sh: $ref is not in $mirror (give --ref)" >&2; return 2; }
    mkdir -p "$src" && git --git-dir="$mirror" archive "$ref" tests scripts examples pyproject.toml | tar -x -C "$src" || return 1
  fi
  if [ "$mode" = te-stub ]; then write_stub "$root/te-stub"; plug=(-p bridge_te_stub); fi
  # As upstream's Launch_Unit_Tests_Core.sh: tests/unit_tests without diffusion, not pleasefixme.
  # Only tests/, scripts/, examples/ and pyproject.toml are extracted, so megatron.bridge comes from the env.
  (cd "$src" && CUDA_VISIBLE_DEVICES="" PYTHONPATH="$root/te-stub" timeout 5400 nice -n 10 \
     "$py" -m pytest -p no:cacheprovider "${plug[@]}" --timeout="$timeout" -q -o addopts="" -rfE \
     --continue-on-collection-errors \
     --junitxml="$out/junit-$mode.xml" $paths --ignore=tests/unit_tests/diffusion \
     -m "not pleasefixme" $pyargs) > "$out/pytest-$mode.log" 2>&1
  echo "pytest rc=$?" >> "$out/pytest-$mode.log"
  echo "== $e ($mode)"; tail -n 2 "$out/pytest-$mode.log"
}

verify() {
  [ -x "$root/fork/bin/megatron-fork-verify" ] || return 0
  (cd /tmp && "$root/fork/bin/megatron-fork-verify" --import) > "$res/fork/verify.txt" 2>&1
  echo "verify rc=$?" >> "$res/fork/verify.txt"
  echo "== fork verify"; grep -vi warn "$res/fork/verify.txt" | tail -n 4
}

compare() {
  "$root/pristine/bin/python" - "$res" "$mode" <<'EOF'
import sys, xml.etree.ElementTree as ET
from pathlib import Path
res = Path(sys.argv[1])
def load(env):
    p = res / env / f"junit-{sys.argv[2]}.xml"
    out = {}
    for tc in ET.parse(p).iter("testcase") if p.exists() else ():
        kind = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), "passed")
        out[f'{tc.get("classname")}::{tc.get("name")}'] = kind
    return out
a, b = load("pristine"), load("fork")
kinds = ("passed", "failure", "error", "skipped")
print("| outcome | pristine | fork |\n|---|---|---|")
for k in kinds:
    print(f"| {k} | {sum(v == k for v in a.values())} | {sum(v == k for v in b.values())} |")
print(f"| total | {len(a)} | {len(b)} |")
diff = sorted(t for t in a.keys() | b.keys() if a.get(t) != b.get(t))
print(f"\ntests whose outcome differs: {len(diff)}")
for t in diff:
    print(f"  {t}: pristine {a.get(t, 'absent')}, fork {b.get(t, 'absent')}")
EOF
}

rc=0
for e in $envs; do
  has env && { make_env "$e" || { echo "env $e failed" >&2; rc=1; continue; }; }
  has deps && { deps "$e" || rc=1; }
  has check && check "$e"
  has tests && tests "$e"
done
has verify && verify
has compare && compare | tee "$res/compare-$mode.txt"
exit $rc
