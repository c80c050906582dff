#!/usr/bin/env bash
# GPU check: a short GRPO training on one GPU. The policy update runs on CUDA in bf16; rollouts
# come from minirl's vLLM engine where vLLM is installed, else from Hugging Face generate (said
# so in the output). Prints step time and tokens/s. Exits 0 without a GPU (nothing to check).
#
#   bash bench/gpu_check.sh            # on a machine with a CUDA GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3)}
if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; fi
exec "$PYTHON" bench/gpu_check.py "$@"
