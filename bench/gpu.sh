#!/usr/bin/env bash
# The GPU benchmark (see bench/gpu.py): a ResNet-50-shaped fp16 model, inferd against in-process.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s .venv/.installed
exec .venv/bin/python -m bench.gpu "$@"
