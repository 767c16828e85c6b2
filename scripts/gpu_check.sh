#!/bin/bash
# A GPU session's check in one call (the device tool's 15 minutes): `pytest -m gpu`, then the lifecycle's stages on
# CUDA (bench/gpu_lifecycle.py). Prepare on a CPU machine first (docs/measurements.md, "The GPU host"):
#   build/gpu_site  the wheels the host lacks, installed for its Python:
#                   pip install --target build/gpu_site --python-version 3.12 --only-binary=:all: \
#                     --platform manylinux2014_x86_64 --implementation cp --no-deps --find-links <wheels> \
#                     deepspeed pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson \
#                     py-cpuinfo msgpack einops psutil pandera typeguard typing-inspect mypy-extensions
#   build/gpu_data  a CPU `make run`'s data root without mlartifacts, mlflow.db and the stores (about 21 MB)
# then: run(command="bash scripts/gpu_check.sh", carry=["build/gpu_site", "build/gpu_data"]).
# Rehearse it on CPU with a venv holding only the host's packages: GPU_CHECK_DEVICE=cpu.
# LIFECYCLE_SKIP: stages left out (default: the three the 15 minutes cannot hold beside the rest).
set -u
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=$(command -v python3)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu_check}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.is_available())"
export PYTHONPATH=$PWD:$PWD/build/gpu_site HF_HUB_OFFLINE=1 TORCH_CUDA_ARCH_LIST=9.0 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  # the whole output to a file: a failure's message is at its top, and the reply keeps only a tail
  # only the files that hold gpu tests: collecting the others would import Dagster, which the host lacks
  timeout 150 $PY -m pytest --noconftest -p no:cacheprovider -p no:logging -o addopts="" -m gpu -q -rA --tb=short \
    $(grep -rl "mark.gpu" tests --include="test_*.py") >"$OUT/pytest_gpu.txt" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|^E |passed|failed" "$OUT/pytest_gpu.txt" | head -40 | cut -c1-300
fi
timeout "${LIFECYCLE_S:-380}" $PY bench/gpu_lifecycle.py --data-root build/gpu_data --device "$DEVICE" \
  --out "$OUT/lifecycle" --skip ${LIFECYCLE_SKIP:-throughput fp16 resume} 2>&1 | tail -12 | cut -c1-1500
find "$OUT" \( -name "*.safetensors" -o -name "*.pt" -o -name "*.bin" \) -delete 2>/dev/null
true
