# syntax=docker/dockerfile:1
#
# Containers of the megatron-core fork: one Dockerfile, one target per GPU vendor.
#
#   docker build --target cuda -t megatron-fork:cuda .
#   docker build --target rocm -t megatron-fork:rocm .
#
# Both targets keep the base image's torch and run the same installer as the README and CI:
#   tools/install.sh --python python3 --no-venv --no-torch [--wheel-dir DIR --offline]
# Offline build: put the hash-pinned upstream wheel of the default base (megatron-core 0.19.2,
# see patches/upstream.toml) into .whl/ in the build context, e.g. with
#   python tools/fork.py fetch --wheel-dir .whl
# and build with --build-arg OFFLINE=1 (UPSTREAM_WHEEL_DIR names another context directory).
# docs/containers.md has the details, the CI wiring and what was not run.

# NGC PyTorch 26.05 (Python 3.12; Transformer Engine and apex come with the image). The digest is
# the one a public project records for this tag; check it with
#   docker buildx imagetools inspect nvcr.io/nvidia/pytorch:26.05-py3
# before relying on it. Upstream Megatron-LM core_v0.18.2 tests on 26.04-py3 (docker/.ngc_version.dev).
ARG CUDA_BASE_IMAGE=nvcr.io/nvidia/pytorch:26.05-py3@sha256:222d8b18e671be5c3ef91cb41727a2572a0b23f59ded6c39f373a96946f6f2ba
# AMD's ROCm 7.2.4 PyTorch 2.10.0 image, Ubuntu 24.04, Python 3.12 (tag and digest as recorded by
# ROCm's own CI runs that use this image).
ARG ROCM_BASE_IMAGE=rocm/pytorch:rocm7.2.4_ubuntu24.04_py3.12_pytorch_release_2.10.0@sha256:4449f856653602317e4101a76fce599c7fcd58ccec2e539951fce5f73083179e

# ---------------------------------------------------------------------------------------------
# rocm/pytorch ships no Transformer Engine, so the ROCm target builds it from a pinned commit of
# ROCm/TransformerEngine (the commit of the 2.15.0.dev0 nightly wheel, local label ...a07e607).
# --no-build-isolation and --no-deps keep the image's torch: nothing here may reinstall it.
# --build-arg ROCM_TE=skip builds no TE (the stage then leaves /wheels/te empty and the rocm
# stage installs none): for a stand-in base without ROCm or GitHub access, never for a real image.
FROM ${ROCM_BASE_IMAGE} AS rocm-te
ARG ROCM_TE=build
ARG ROCM_TE_REPO=https://github.com/ROCm/TransformerEngine.git
ARG ROCM_TE_COMMIT=a07e607f14a5330807ffdafeeb6224f2d7dffacc
# gfx942 = MI300X/MI325X; add gfx950 (MI355X) as needed, separated by ';'.
ARG NVTE_ROCM_ARCH=gfx942
ARG MAX_JOBS=16
ENV NVTE_FRAMEWORK=pytorch \
    NVTE_USE_ROCM=1 \
    NVTE_USE_HIPBLASLT=1 \
    NVTE_ROCM_ARCH=${NVTE_ROCM_ARCH} \
    MAX_JOBS=${MAX_JOBS}
WORKDIR /src/TransformerEngine
RUN case "${ROCM_TE}" in \
      build) git init -q . \
        && git remote add origin "${ROCM_TE_REPO}" \
        && git fetch -q --depth 1 origin "${ROCM_TE_COMMIT}" \
        && git checkout -q FETCH_HEAD \
        && git submodule update -q --init --recursive --depth 1 \
        && python -m pip wheel --no-build-isolation --no-deps -w /wheels/te . ;; \
      skip) mkdir -p /wheels/te ;; \
      *) echo "ROCM_TE must be build or skip, not ${ROCM_TE}" >&2; exit 2 ;; \
    esac

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_BASE_IMAGE} AS cuda
ARG UPSTREAM_WHEEL_DIR=.whl
ARG OFFLINE=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /opt/megatron-fork
# The licence of what the image adds: upstream's LICENSE and the fork's NOTICE, where a
# distribution puts a package's licence (docs/containers.md); the wheel's .dist-info has them too.
COPY LICENSE NOTICE /usr/share/doc/megatron-core-fork/
COPY . /opt/megatron-fork
# Same installer as everywhere else; --no-torch keeps the NGC torch (and TE/apex built against it).
# The wheel kit when there is one (--offline needs it). install.sh ends with the smoke: the
# installed fork matches its manifest and both packages import, from / (so the working
# directory's megatron/ cannot shadow the install).
# hadolint ignore=SC2046
RUN bash tools/install.sh --python python3 --no-venv --no-torch \
        $( [ "${OFFLINE}" = 1 ] && echo --offline ) \
        $( [ -d "${UPSTREAM_WHEEL_DIR}" ] && echo --wheel-dir "${UPSTREAM_WHEEL_DIR}" )

# ---------------------------------------------------------------------------------------------
FROM ${ROCM_BASE_IMAGE} AS rocm
ARG ROCM_TE=build
ARG UPSTREAM_WHEEL_DIR=.whl
ARG OFFLINE=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
COPY --from=rocm-te /wheels/te /tmp/te-wheels
RUN if [ "${ROCM_TE}" = skip ]; then \
      echo "ROCM_TE=skip: no Transformer Engine installed"; \
    else \
      python -m pip install --no-deps --no-index /tmp/te-wheels/*.whl \
      && python -c "import transformer_engine.pytorch"; \
    fi \
    && rm -rf /tmp/te-wheels
WORKDIR /opt/megatron-fork
# The licence files, as in the cuda stage.
COPY LICENSE NOTICE /usr/share/doc/megatron-core-fork/
COPY . /opt/megatron-fork
# Installed and smoke-tested as in the cuda stage (install.sh verifies with --import).
# hadolint ignore=SC2046
RUN bash tools/install.sh --python python3 --no-venv --no-torch \
        $( [ "${OFFLINE}" = 1 ] && echo --offline ) \
        $( [ -d "${UPSTREAM_WHEEL_DIR}" ] && echo --wheel-dir "${UPSTREAM_WHEEL_DIR}" )

# The last stage is the default target; keep it the CUDA one.
FROM cuda AS default
