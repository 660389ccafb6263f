#!/usr/bin/env bash
# Install this checkout's distributions on a GPU machine that reaches no package index (its torch,
# cuda-bindings and NVRTC are already there), then print what the benchmarks need to know.
#   bash benchmarks/device_setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e core -e ops_builtin -e mappings_builtin -e mappings_aten -e . \
    $(for p in plugins/*/; do printf -- '-e %s ' "$p"; done)
python3 -c "import torch, kiln; print('torch', torch.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
