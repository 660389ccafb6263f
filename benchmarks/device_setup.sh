#!/usr/bin/env bash
# Install this checkout's distributions on a GPU machine that reaches no package index (its torch,
# cuda-bindings and NVRTC are already there), then print what the benchmarks need to know.
#   bash benchmarks/device_setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e core -e ops_builtin -e mappings_builtin -e mappings_aten -e . \
    $(for p in plugins/*/; do printf -- '-e %s ' "$p"; done)
# Kiln's modules as bytecode, as pip compiles an installed wheel's: an editable install does not,
# and where PYTHONDONTWRITEBYTECODE is set each process would compile them again (some 0.6 s of
# every compile_bench child's import and plugin loading)
python3 -m compileall -q -j 0 core ops_builtin mappings_builtin mappings_aten plugins
# pure-Python test packages the machine lacks (expecttest, for PyTorch's OpInfo database), as
# wheels downloaded here into the ignored .whl/ (see the device README) and carried with the call
if compgen -G ".whl/*.whl" >/dev/null; then python3 -m pip install -q --no-index --no-deps .whl/*.whl; fi
python3 -c "import torch, kiln; print('torch', torch.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
