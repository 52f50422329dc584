#!/usr/bin/env bash
# Downloads the wheels that benchmarks/device_check.sh installs on a GPU machine without
# network: what this project needs beyond PyTorch, Triton and transformers (which such a
# machine has), built for its Python (3.12, x86-64 Linux). Run here, from anywhere:
#
#     tools/fetch_device_wheels.sh [DIR]        (default: .whl, which git ignores)
#
# then take DIR along to the GPU machine, beside the checkout. Pure-Python and manylinux
# wheels only; pip resolves each package's own requirements for that Python and platform.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --dest "$dest" \
    "trio>=0.30" "hypercorn>=0.18,<0.19" "quart-trio>=0.12" "pynng>=0.8" "msgpack>=1.0" \
    "pydantic>=2.7" "prometheus_client>=0.20" "httpx>=0.27" "tqdm>=4.60" \
    "pytest>=8.4" "pytest-trio>=0.8" "llguidance>=1.9,<2" "jsonschema>=4.0"
echo "$(ls "$dest" | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
