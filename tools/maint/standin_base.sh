#!/usr/bin/env bash
# A local stand-in for the containers' base images (NGC PyTorch, rocm/pytorch), so that the
# Dockerfile's targets can be built with podman on a machine that can pull neither.
#
# Usage (repository root or anywhere; root, since debootstrap and podman storage need it):
#   tools/maint/standin_base.sh [--python PY] [--tag TAG] [--workdir DIR] [--force]
#
# What it makes, like the real bases where the Dockerfile relies on them:
#   - a Debian bookworm root (debootstrap --variant=minbase) with g++ (the fork compiles its
#     dataset helper), git and patch (tools/fork.py materialize needs both) and the
#     shared libraries CPython needs;
#   - CPython 3.12 under /usr/local (python3, python, pip on PATH), copied from an existing
#     build: --python PY (default: the interpreter tools/install.sh would pick), without its
#     site-packages; pip comes from its own ensurepip. Debian ships no 3.12 (bookworm has 3.11,
#     trixie 3.13), so a built CPython is copied; it must be linked against a glibc no newer
#     than bookworm's;
#   - torch 2.13.0 from PyPI (the CUDA build; it imports without a GPU), numpy, setuptools,
#     pybind11, packaging and wheel, which the NGC image also carries and which
#     `tools/install.sh --offline` needs to find in the image. pyyaml and einops are left out on
#     purpose: the offline kit in .whl/ brings them.
# Unlike the real bases it has no CUDA toolkit, no ROCm, no Transformer Engine and no apex.
#
# Options and environment:
#   --python PY    the CPython 3.12 to copy (STANDIN_PYTHON)
#   --tag TAG      image name (STANDIN_TAG; default localhost/megatron-fork-standin:py3.12-torch2.13.0)
#   --workdir DIR  scratch and wheel cache (STANDIN_WORKDIR; default build/standin). The wheels
#                  stay there, so a second creation downloads nothing.
#   --force        rebuild even when the image exists (otherwise: print the tag and exit 0)
#   STANDIN_MIRROR Debian mirror for debootstrap (default http://deb.debian.org/debian)
# Prints the image tag as the last line of stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."

py=${STANDIN_PYTHON:-}
tag=${STANDIN_TAG:-localhost/megatron-fork-standin:py3.12-torch2.13.0}
workdir=${STANDIN_WORKDIR:-build/standin}
mirror=${STANDIN_MIRROR:-http://deb.debian.org/debian}
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "standin_base.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

for tool in podman debootstrap tar; do
  command -v "$tool" >/dev/null || { echo "standin_base.sh: $tool not found (apt-get install podman debootstrap)" >&2; exit 2; }
done
if [ "$force" = 0 ] && podman image exists "$tag"; then
  echo "standin_base.sh: $tag exists (--force rebuilds it)" >&2
  echo "$tag"
  exit 0
fi

[ -n "$py" ] || py=$(bash tools/install.sh --print-python)
prefix=$("$py" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version; print(sys.base_prefix)')
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
mkdir -p "$workdir"
workdir=$(cd "$workdir" && pwd)
root="$workdir/root"
t0=$(date +%s)
step() { echo "==> [$(($(date +%s) - t0))s] $*" >&2; }

# 1. The wheels, downloaded by the host's pip for the host's CPython 3.12 (same tags as the
#    image's) and kept as a cache. The image installs them from there, without an index.
step "wheels for python $ver into $workdir/wheels"
"$py" -m pip download -q --disable-pip-version-check --only-binary :all: -d "$workdir/wheels" \
  pip torch==2.13.0 numpy "setuptools>=80" pybind11 "packaging>=24.2" wheel >&2

# 2. The Debian root.
step "debootstrap bookworm (minbase) into $root"
rm -rf "$root"
debootstrap --variant=minbase \
  --include=g++,git,patch,libssl3,libffi8,zlib1g,libbz2-1.0,liblzma5,libsqlite3-0,libreadline8,libncursesw6,libexpat1,libtirpc3,ca-certificates \
  bookworm "$root" "$mirror" >"$workdir/debootstrap.log" 2>&1 \
  || { tail -20 "$workdir/debootstrap.log" >&2; exit 1; }
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*

# 3. CPython under /usr/local, without the copied build's site-packages and test suite.
step "CPython $ver from $prefix into /usr/local"
tar -C "$prefix" -c \
  --exclude="./lib/python$ver/site-packages/*" --exclude="./lib/python$ver/test" \
  --exclude='__pycache__' bin include lib share 2>/dev/null | tar -C "$root/usr/local" -x
# Drop the copied build's own scripts (pip, idle, ...) whose shebangs name its old prefix.
find "$root/usr/local/bin" ! -type d ! -name "python$ver" ! -name "python$ver-config" -delete
ln -sf "python$ver" "$root/usr/local/bin/python3"
ln -sf "python$ver" "$root/usr/local/bin/python"
ln -sf "python$ver-config" "$root/usr/local/bin/python3-config"
chroot "$root" /sbin/ldconfig
# The root's own pip (scripts pip, pip3 come with the upgrade in the torch layer below); a clean
# environment, so that this machine's pip settings do not leak in.
chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin \
  python3 -m ensurepip >/dev/null

# 4. Import the root, then install the wheels in a build step of its own (a second layer).
step "podman import"
tar -C "$root" -c . | podman import -q \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' - "$tag-root" >/dev/null
rm -rf "$root"
ctx="$workdir/context"
mkdir -p "$ctx"
cat >"$ctx/Containerfile" <<EOF
FROM $tag-root
RUN python3 -m pip install --no-cache-dir --disable-pip-version-check --no-index \
      --find-links /wheels --upgrade pip \
    && pip install --no-cache-dir --disable-pip-version-check --no-index \
      --find-links /wheels torch==2.13.0 numpy "setuptools>=80" pybind11 "packaging>=24.2" wheel \
    && python3 -c "import torch, numpy; print('stand-in: python', __import__('sys').version.split()[0], 'torch', torch.__version__)"
EOF
step "podman build $tag (torch layer)"
podman build --isolation=chroot --pull=never -v "$workdir/wheels:/wheels:ro" \
  -t "$tag" "$ctx" >&2
podman untag "$tag-root" >/dev/null 2>&1 || true
step "done: $(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.1f GB", $1/1e9}')"
echo "$tag"
