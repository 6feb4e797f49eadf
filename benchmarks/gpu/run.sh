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
# The checkout first: torchrl's wheel installs top-level `benchmarks` and `scripts` folders of its own.
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
import importlib, sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
for name in ("tensordict", "pydantic", "torchrl"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # torchrl's rows are skipped without it; the others are needed
        print(name, "not importable:", type(e).__name__, e)
PYEOF
} 2>&1 | tee "$OUT/env.txt"
# SIGINT at the limit, not SIGTERM: pytest then still prints the tables (its terminal summary).
timeout -s INT -k 30 "${LIMIT:-420}" "$PY" -m pytest benchmarks/test_buffer_throughput.py \
  benchmarks/test_paired.py -q -p no:randomly --benchmark-only --device "$DEVICE" \
  --benchmark-max-time="${MAX_TIME:-0.5}" 2>&1 | tee "$OUT/bench.txt"
exit "${PIPESTATUS[0]}"
