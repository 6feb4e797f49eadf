#!/usr/bin/env bash
# Download, here, the wheels the GPU variant of `make bench` needs on a lent device machine.
#
# The device image (see the device tool's KINDS.md) has Python 3.12 with torch, numpy, pytest,
# pytest-benchmark and hypothesis, no package registry, and none of: tensordict, pydantic,
# torchrl. This puts those, pinned to the versions of this checkout's venv, in .gpu-wheels/
# (git-ignored), which `run` carries to the device: see benchmarks/gpu/README.md.
#
# tensordict's C extension links no libtorch symbol (only Python's and libstdc++'s), so its
# wheel does not depend on the torch it is installed beside; torchrl's does, and torchrl then
# runs without it (as it does here: its prioritized sampler is the only loss).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}  # the device image's python3
DEST=${DEST:-.gpu-wheels}
PKGS="tensordict torchrl hoptorch pydantic pydantic_core annotated-types typing-inspection typing_extensions orjson pyvers importlib_metadata"
pins=()
for p in $PKGS; do
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")
  pins+=("$p==$v")
done
rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download --quiet --dest "$DEST" --no-deps --only-binary=:all: \
  --implementation cp --python-version "$PYVER" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any "${pins[@]}"
ls -l "$DEST"
du -sh "$DEST"
