#!/usr/bin/env bash
# The TPU and GPU compilers for the deviceless AOT tests, in their own environment (.aot-venv) beside the project's:
# installed where jaxserve runs, the CUDA plugin writes CUDA warnings into every jax process's stderr (and the
# CLI's one-line errors). The venv sees the project's packages (install them first) and adds the compilers.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .aot-venv/bin/python ]; then
    python -m venv --system-site-packages .aot-venv
fi
.aot-venv/bin/pip install -q -e ".[tpu-aot,gpu-aot]"
