#!/usr/bin/env bash
# Installs Horovod 0.28.1 with its PyTorch extension (gloo + MPI controllers) for the
# torch that is installed, building the wheel from the PyPI sdist once and caching it.
#
#   bash scripts/install_horovod.sh
#
# Why a build: PyPI's horovod 0.28.1 compiles its PyTorch extension as C++14, which
# PyTorch >= 2.1 headers reject. This script downloads the sdist, raises
# CMAKE_CXX_STANDARD to 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt, and builds
# with HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 (OpenMPI headers
# needed: libopenmpi-dev). About 20 minutes on 2 cores.
#
# Order of preference (idempotent, cheap when already done):
#   1. `import horovod.torch` already works            -> nothing to do, never rebuilds
#   2. a cached wheel for this Python + torch exists    -> pip install it
#   3. otherwise build the wheel, cache it, install it
#
# Environment:
#   HIPRESS_WHEEL_CACHE   cache dir (default $HOME/.cache/hipress/wheels); the wheel is kept in
#                         $HIPRESS_WHEEL_CACHE/horovod-0.28.1/<python tag>-torch<version>/
#   HIPRESS_BUILD_JOBS    parallel compile jobs (default: nproc)
#   HIPRESS_HOROVOD_NICE  niceness of the build (default 10; the build is long and CPU-bound)
#   HIPRESS_SKIP_APT=1    do not apt-get the OpenMPI/cmake prerequisites
#   PYTHON                interpreter to install for (default python3)
set -euo pipefail
PY=${PYTHON:-python3}
HVD_VERSION=0.28.1
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
log() { printf '[install_horovod] %s\n' "$*"; }
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if "$PY" -c 'import horovod.torch' >/dev/null 2>&1; then
  log "horovod.torch already imports ($("$PY" -c 'import horovod; print(horovod.__version__)')); nothing to do"
  exit 0
fi

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  log "torch is not importable by $PY; install torch first (bash scripts/setup.sh)" >&2
  exit 1
fi

CACHE_ROOT=${HIPRESS_WHEEL_CACHE:-$HOME/.cache/hipress/wheels}
KEY=$("$PY" -c 'import sys, torch; print("cp%d%d-torch%s" % (sys.version_info[0], sys.version_info[1], torch.__version__.replace("+", "_")))')
CACHE_DIR="$CACHE_ROOT/horovod-$HVD_VERSION/$KEY"
mkdir -p "$CACHE_DIR"

# Horovod's runtime dependencies (also needed while building: setup_requires).
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi

install_cached() {
  local whl
  whl=$(ls -1 "$CACHE_DIR"/horovod-"$HVD_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  [ -n "$whl" ] || return 1
  log "installing cached wheel $whl"
  "$PY" -m pip install -q --no-deps --force-reinstall "$whl"
}

if ! install_cached; then
  # Prerequisites: OpenMPI headers/launcher and cmake >= 3.13.
  apt_install_missing mpicxx:libopenmpi-dev,openmpi-bin cmake:cmake g++:g++ make:make
  if ! command -v cmake >/dev/null; then
    log "no cmake on PATH; installing cmake from PyPI"
    "$PY" -m pip install -q cmake
  fi

  WORK=$(mktemp -d "${TMPDIR:-/tmp}/hipress-horovod-build.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  log "downloading the horovod==$HVD_VERSION sdist"
  (cd "$WORK" && "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d .)
  tar -xzf "$WORK/horovod-$HVD_VERSION.tar.gz" -C "$WORK"
  SRC="$WORK/horovod-$HVD_VERSION"

  # The fix: C++17 for the core library and for the PyTorch extension.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  if grep -q 'set(CMAKE_CXX_STANDARD 14)' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; then
    log "could not raise CMAKE_CXX_STANDARD to 17" >&2; exit 1
  fi

  jobs=${HIPRESS_BUILD_JOBS:-$(nproc)}
  log "building the horovod wheel (torch $("$PY" -c 'import torch; print(torch.__version__)'), $jobs jobs; ~20 min on 2 cores)"
  (
    cd "$SRC"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    export MAKEFLAGS="-j$jobs"
    # pip's cmake 4.x refuses Horovod's cmake_minimum_required(3.13) without this.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    # --no-build-isolation: the extension is built against the installed torch.
    nice -n "${HIPRESS_HOROVOD_NICE:-10}" "$PY" -m pip wheel -v --no-deps --no-build-isolation \
      -w "$WORK/dist" . > "$WORK/build.log" 2>&1 || {
        tail -n 60 "$WORK/build.log" >&2; log "build failed (log above)" >&2; exit 1; }
  )
  whl=$(ls -1 "$WORK"/dist/horovod-*.whl | head -n1)
  cp "$whl" "$CACHE_DIR/"
  log "cached $(basename "$whl") in $CACHE_DIR"
  install_cached
fi

"$PY" - <<'EOF'
import horovod.torch as hvd
print('[install_horovod] horovod', __import__('horovod').__version__,
      '| gloo:', hvd.gloo_built(), '| mpi:', hvd.mpi_built())
EOF
