#!/usr/bin/env bash
# Sets up everything hipress needs on a fresh machine (Debian/Ubuntu, Python >= 3.9)
# and builds hipress in place (editable). Idempotent: a second run only rebuilds.
#   bash scripts/setup.sh
# Environment: HIPRESS_SKIP_APT=1 skips system packages; HIPRESS_WITH_CUDA / HIPRESS_WITH_MPI
# (auto|0|1) choose the optional native parts (see setup.py); HIPRESS_WITH_HOROVOD=1 also
# installs Horovod (scripts/install_horovod.sh: a cached wheel, or a ~20 min build once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[setup] %s\n' "$*"; }
# shellcheck source=scripts/common.sh
source scripts/common.sh

# System packages: OpenMPI (mpirun + headers for the native MPI transport),
# iproute2 (ip netns / tc) and iptables (packet delay where the kernel has no netem)
# for the emulated cluster benchmark.
apt_install_missing mpicxx:libopenmpi-dev,openmpi-bin ip:iproute2 tc:iproute2 iptables:iptables

# Python packages. torch is pinned: a bare "torch" would pull the CUDA build (GBs).
log "installing Python packages"
# accelerate and lightning: the tests of docs/ddp.md's recipes (examples/recipes/), pinned to
# the versions they were written against. optuna: bucket_bytes="tune"'s Bayesian optimisation
# (GPSampler; docs/dear.md), imported only when a job tunes.
$PY -m pip install -q "torch==2.13.0" numpy pybind11 setuptools wheel \
  pytest pytest-timeout hypothesis scikit-learn matplotlib "accelerate==1.15.0" "lightning==2.6.6" "optuna==4.6.0"
if command -v mpicxx >/dev/null; then
  $PY -m pip install -q mpi4py
fi
$PY -m pip install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96  # nvcc for the CompLL CUDA back end (hipress/dsl/build.py NVCC_WHEELS; compile-only tests need no GPU)

log "building hipress (editable; compiles csrc/ into hipress._C)"
HIPRESS_BUILD_JOBS=${HIPRESS_BUILD_JOBS:-$(nproc)} $PY -m pip install -q --no-build-isolation -e .
$PY -c "import hipress, hipress._C as C; print('[setup] hipress', hipress.__version__, '| mpi:', C.with_mpi, '| cuda:', C.with_cuda)"

if is_on HIPRESS_WITH_HOROVOD 0; then
  # Optional: without Horovod, hipress works and the horovodrun tests skip, saying why.
  bash scripts/install_horovod.sh || log "WARNING: Horovod could not be installed; horovodrun tests will skip"
fi
