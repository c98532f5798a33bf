#!/usr/bin/env bash
# The GPU check from a bare GPU machine (PyTorch with CUDA, transformers and peft there; no
# network): wheels carried in .whl/ (torchao, bitsandbytes: see docs/gpu.md) go to a scratch
# directory, then bench/gpu_check.py runs the `cuda` tests and the benchmark into OUT_DIR.
#   bash bench/gpu_check.sh OUT_DIR [bench/gpu_check.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [options of bench/gpu_check.py]}
shift
site=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        || echo "gpu_check: the wheels in .whl/ did not install; going on without them"
fi
export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 bench/gpu_check.py "$out" "$@"
