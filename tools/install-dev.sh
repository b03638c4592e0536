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
python -m pip install --quiet -e ".[test]" -e backends/cpu
[ -d conformance ] && python -m pip install --quiet -e conformance
for b in cuda rocm xpu hpu npu kunlunxin; do
  [ -f "backends/$b/pyproject.toml" ] && python -m pip install --quiet --no-deps -e "backends/$b"
done
python -m pip list 2>/dev/null | grep -iE '^(torch|ds-core|pluggy|pydantic|pytest) ' || true
