#!/usr/bin/env bash
# Every GPU check and benchmark, in one run, for a machine with a CUDA GPU (an H200
# lent by the device tool, or any CUDA box): the gpu-marked tests, the kernel
# benchmark (diff, apply, publish encode, the context codec's select_ranks/apply_ranks)
# and the engine-pause benchmark. Results go
# under $OUT (default ./gpu-results): pytest's log and JUnit XML, bench_gpu.json,
# bench_pause.json.
#
# The machine needs CuPy, torch and the project's runtime dependencies. Without a
# network, carry them as wheels: from the repo root, on a machine with one,
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl numpy pydantic pydantic-core annotated-types typing-inspection zstandard lz4 \
#       boto3 botocore s3transfer jmespath click aiohttp ...
# and set BULLETIN_WHEELS=.whl; they are installed to a private folder first.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="${OUT:-$repo/gpu-results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if [[ -n "${BULLETIN_WHEELS:-}" ]]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/bulletin-site "$BULLETIN_WHEELS"/*.whl
    export PYTHONPATH="/tmp/bulletin-site:${PYTHONPATH:-}"
fi
# bulletin_kernels lives in kernels/ (docs/ARCHITECTURE.md, the kernels' name).
export PYTHONPATH="$repo:$repo/kernels:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
status=0
"$py" -m pytest -m gpu -p no:cacheprovider -q -o addopts="" --junitxml="$out/gpu-tests.xml" \
    tests/kernels/test_cuda.py tests/run/test_gpu_publish.py tests/run/test_gpu_recovery.py \
    tests/sidecar/test_torch_target_gpu.py \
    2>&1 | tee "$out/gpu-tests.log" || status=1
"$py" scripts/bench_gpu.py --no-tests --out "$out" 2>&1 | tee "$out/bench_gpu.log" || status=1
"$py" scripts/bench_pause.py --json "$out/bench_pause.json" 2>&1 | tee "$out/bench_pause.log" || status=1
exit $status
