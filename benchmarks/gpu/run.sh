#!/usr/bin/env bash
# The GPU variant of `make bench`, as one command on a lent device machine (see README.md here).
#
# Installs the carried wheels (.gpu-wheels/, from wheels.sh) into $SITE (/tmp/site), records
# the machine, then runs the throughput and paired benchmarks with --device cuda. Everything
# goes to $OUT (the device tool brings it back): env.txt, bench.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
WHEELS=${WHEELS:-.gpu-wheels}
SITE=${SITE:-/tmp/site}
export PYTHONPATH=".:$SITE"
mkdir -p "$OUT"
{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nproc
  # Into a folder of its own, not the image's venv (the device tool's README recipe).
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || echo "wheel install failed"
  "$PY" - <<'PYEOF'
import sys, torch, tensordict, pydantic
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
print("tensordict", tensordict.__version__, "pydantic", pydantic.VERSION)
try:
    import torchrl.data
    print("torchrl", torchrl.__version__)
except Exception as e:
    print("torchrl not importable (its rows are skipped):", type(e).__name__, e)
PYEOF
} 2>&1 | tee "$OUT/env.txt"
# One thread on the host side, as on the CPU: the GPU rows time launches plus device work.
timeout "${LIMIT:-420}" "$PY" -m pytest benchmarks/test_buffer_throughput.py \
  benchmarks/test_paired.py -q -p no:randomly --benchmark-only --device "$DEVICE" \
  --benchmark-max-time="${MAX_TIME:-0.5}" 2>&1 | tee "$OUT/bench.txt"
exit "${PIPESTATUS[0]}"
