#!/usr/bin/env bash
# Install ds_core, every backend package, the conformance suite and the test tools into the
# active Python environment, for development and CI.
#
# torch is pinned to 2.13.0 so pip takes the CPU build instead of downloading a CUDA one.
# Vendor backend packages are installed with --no-deps: their vendor stacks (torch-npu, ...)
# pin their own torch and are never installed into a test environment; their tests drive
# recorded fakes of the vendor modules instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
# DeepSpeed itself, for tests that compare ds_core against it (skipped when it is absent):
# --no-deps and no build isolation keep the pinned torch, DS_BUILD_OPS=0 builds no op; its
# other requirements are installed explicitly.
python -m pip install --quiet einops hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic tqdm
DS_BUILD_OPS=0 python -m pip install --quiet --no-deps --no-build-isolation "deepspeed==0.19.8"
python -m pip install --quiet -e ".[test]" -e backends/cpu -e backends/sim
# Lightning, Transformers and Accelerate, for the interop adapters' tests (skipped when absent),
# at the versions the tests were written against: --no-deps keeps the pinned torch (lightning
# 2.6 also names pytorch-lightning, which it does not import); their other requirements are
# installed explicitly (transformers needs safetensors >= 0.8).
python -m pip install --quiet PyYAML "lightning-utilities>=0.10,<2" "huggingface-hub>=2.4,<3" \
  regex "tokenizers>=0.23.1,<0.24" typer "kernels>=0.19.1,<0.20" "safetensors>=0.8"
python -m pip install --quiet --no-deps "lightning==2.6.6" "torchmetrics==1.9.0" \
  "transformers==5.25.0" "accelerate==1.16.0"
python -c "import lightning, transformers, accelerate"
[ -d conformance ] && python -m pip install --quiet -e conformance
for b in cuda rocm xpu hpu npu kunlunxin; do
  [ -f "backends/$b/pyproject.toml" ] && python -m pip install --quiet --no-deps -e "backends/$b"
done
# The sim device is a C++ extension: build it now (into ds_core.ops' cache) rather than inside
# the first test that needs it. Cold and warm build times are printed.
python - <<'PY'
import time
start = time.perf_counter()
from ds_backend_sim import device
device.extension(quiet=True)
print(f"sim extension ready in {time.perf_counter() - start:.1f} s")
PY
python -m pip list 2>/dev/null | grep -iE '^(torch|ds-core|pluggy|pydantic|pytest|lightning|transformers|accelerate) ' || true
