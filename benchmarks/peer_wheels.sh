#!/bin/bash
# The peers' packages for the GPU machine (Python 3.12, x86-64, no network), staged as
# chunk folders small enough to travel: .gpu-wheels/q00, q01, ... (58 MiB each at most; a
# device call carries 64 MiB with the checkout). Run after ../shared/tools/gpu-wheels (it
# empties .gpu-wheels):
#   benchmarks/peer_wheels.sh
# The list is what `import streaming, litdata, webdataset, ffcv` and the peer tests needed
# beyond that machine's own packages (torch, torchvision, numpy, PIL, OpenCV, timm and its
# Hugging Face packages), found by running tests/loader/bench/test_peers.py against a copy
# of those alone; FFCV itself from benchmarks/ffcv_offline.sh. On the machine, once every
# chunk's part is in /tmp/gq: cat /tmp/gq/part* | tar x -C /tmp, then
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/peers/all/*.whl
#   cp -r /tmp/peers/ffcv /tmp/site/
set -euo pipefail
cd "$(dirname "$0")/.."
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/peers/all"
binary=(mosaicml-streaming==0.13.0 litdata==0.2.76 webdataset==1.0.2 numba==0.68.1
  llvmlite==0.50.0 terminaltables==3.1.10 pytorch-pfn-extras==0.9.0 psutil==7.2.2
  transformers==4.57.6 regex huggingface_hub==0.36.2 httpx2 httpcore2 truststore h11
  tokenizers==0.22.2 brotli python-snappy cramjam zstd xxhash catalogue lightning-utilities
  boto3 botocore s3transfer python-dateutil jmespath braceexpand six)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
  --platform manylinux2010_x86_64 -d "$stage/peers/all" "${binary[@]}" 2> "$stage/pip.log" ||
  { grep -v "^WARNING" "$stage/pip.log" >&2; exit 1; }
# pure Python, published as sdists only
python3 -m pip wheel -q --no-deps -w "$stage/peers/all" fastargs==1.2.0 assertpy==1.1 \
  2> "$stage/pip.log" || { grep -v "^WARNING" "$stage/pip.log" >&2; exit 1; }
benchmarks/ffcv_offline.sh "$stage/peers" > /dev/null
tar cf "$stage/peers.tar" -C "$stage" peers
mkdir -p .gpu-wheels && rm -rf .gpu-wheels/q[0-9][0-9]
(cd .gpu-wheels && split -b 58M -d -a 2 "$stage/peers.tar" part &&
  for f in part*; do mkdir "q${f#part}" && mv "$f" "q${f#part}/"; done)
echo "staged $(du -sh "$stage/peers.tar" | cut -f1) in $(ls -d .gpu-wheels/q* | wc -l) chunk folders (.gpu-wheels/q00 ..)"
