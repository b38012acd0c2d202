#!/bin/bash
# The checks that need a CUDA GPU (torch with CUDA, nvcc), run from the repository root:
#   bash scripts/gpu_check.sh [OUT_DIR]        (default results/gpu)
# 1. build and install hipress (no dependencies fetched: the GPU image has torch, numpy, pybind11, pytest);
# 2. compile every shipped spec's CUDA library (in parallel; cached for the steps below);
# 3. tests/gpu (CUDA kernels against the CPU back end), tests/unit/test_dsl_cuda.py with a GPU present;
# 4. the optimizer and DDP-hook test workers with their models on the GPU (HIPRESS_TEST_DEVICE=cuda);
# 5. python -m hipress.bench.cuda_kernels (alone on the GPU, last).
# Each step has a time limit and a log in OUT_DIR; the script goes on after a failed step and
# exits non-zero if any failed.
out=${1:-results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HIPRESS_TEST_CUDA_ARCH=${HIPRESS_TEST_CUDA_ARCH:-sm_90}
failed=""
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc, $((SECONDS - t0)) s"; tail -n 4 "$out/$name.log"
    [ $rc = 0 ] || failed="$failed $name"
}
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; nvcc --version | tail -1
step build 300 python3 -m pip install --no-build-isolation --no-deps -e .
# the workers' multi-rank runs use the built-in kernels, not the DSL's CUDA libraries: beside steps 2-3
(step on_cuda_optimizer 300 env HIPRESS_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
     tests/multiproc/test_optimizer.py -k "exact_average or algorithms_match_reference or training_matches_ddp"
 step on_cuda_ddp_hook 300 env HIPRESS_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
     tests/multiproc/test_ddp_hook.py
 [ -z "$failed" ]) > "$out/on_cuda.summary" 2>&1 &
workers=$!
step cuda_libs 240 python3 -c "
from concurrent.futures import ThreadPoolExecutor
from hipress import compll
specs = compll.cuda_specs()
with ThreadPoolExecutor(16) as ex:
    for s, (_, path) in zip(specs, ex.map(lambda s: compll.build(s, cuda=True), specs)):
        print(s, path)"
step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/gpu tests/unit/test_dsl_cuda.py
wait $workers || failed="$failed on_cuda"
cat "$out/on_cuda.summary"
step bench 180 python3 -m hipress.bench.cuda_kernels --out "$out/cuda_kernels.json"
echo "failed:${failed:- none}"
[ -z "$failed" ]
