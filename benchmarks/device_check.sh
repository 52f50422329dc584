#!/usr/bin/env bash
# The GPU path, checked on a machine with one NVIDIA GPU, PyTorch and Triton installed and no
# network, in under 5 minutes:
#   1. installs what this project needs and the machine lacks, from the wheels in .whl/
#      (fetched beforehand, where there is network, by tools/fetch_device_wheels.sh);
#   2. runs the Triton kernels' tests on CUDA against the torch reference, the CUDA-graph
#      decode step against the eager one, greedy parity with transformers for the three
#      tiny architectures with --attention-backend triton on CUDA, seeded sampling
#      against the torch sampler, and structured output's masks on the device;
#   3. times the decode step of a Llama-3-8B-shaped model (random weights) at batch 1, 32
#      and 128, eager and by graph replay, against the HBM roofline (benchmarks/gpu_decode.py).
#
#     benchmarks/device_check.sh            (from the checkout, .whl/ in it)
#
# GPU_DECODE_ARGS replaces the benchmark's arguments; with TRITON_INTERPRET=1 and
# GPU_DECODE_ARGS="--shape tiny --device cpu --batch 1 --context 40" it runs on a CPU, slowly,
# to check the script itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
needs="import trio, hypercorn, quart_trio, pynng, msgpack, pydantic, prometheus_client, httpx"
needs+=", tqdm, pytest, pytest_trio, llguidance, jsonschema"
if ! "$python" -c "$needs" 2>/dev/null; then
    if [ ! -d .whl ]; then
        echo "packages are missing and there is no .whl/: run tools/fetch_device_wheels.sh" >&2
        exit 1
    fi
    echo "== installing from .whl/ into /tmp/device-site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/device-site .whl/*.whl
    export PYTHONPATH=/tmp/device-site${PYTHONPATH:+:$PYTHONPATH}
    "$python" -c "$needs"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$python" - <<'PY'
import sys, torch, triton
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, {gpu}")
PY
echo "== Triton kernels, CUDA graphs, greedy parity (triton backend), structured output"
"$python" -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_decode_graphs.py \
    tests/test_parity.py::test_triton_kernels_greedy_parity \
    tests/test_parity.py::test_triton_sampling_draws_what_the_torch_sampler_draws \
    tests/test_structured_engine.py::test_masks_apply_on_cuda
echo "== decode step, Llama-3-8B shape"
# shellcheck disable=SC2086  # GPU_DECODE_ARGS is a list of arguments
"$python" -m benchmarks.gpu_decode ${GPU_DECODE_ARGS:---batch 1 32 128}
