#!/usr/bin/env bash
# One call on the device machine: install carried wheels, run the GPU tests, then the given benchmark commands.
#   bash benchmarks/tools/run_on_gpu.sh "python benchmarks/tools/cce_tune.py" "python benchmarks/cce.py --out \$OUT/cce"
# Logs go to $OUT (the device tool brings them back). Pure-Python wheels the GPU image lacks go in .whl/ (ignored
# by git; carry it): python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#   expecttest accelerate cut-cross-entropy liger-kernel
set -uo pipefail
OUT=${OUT:-benchmark_results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/memopt_install.log 2>&1 \
  || echo "editable install failed (backend='memopt' by name unavailable); see /tmp/memopt_install.log"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, triton
from torch.fx.experimental import symbolic_shapes
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
print("optimization_hint:", hasattr(symbolic_shapes, "optimization_hint"), "size_hint:", hasattr(symbolic_shapes, "size_hint"))
PY
if [ "${MEMOPT_GPU_TESTS:-1}" = 1 ]; then
  timeout "${MEMOPT_TEST_TIMEOUT:-300}" python3 -m pytest tests/lowerings -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
for cmd in "$@"; do
  echo "== $cmd"
  eval "$cmd" 2>&1 | tee -a "$OUT/benchmarks.log" | tail -60
done
# The device tool brings back only a few files a call: past a handful, $OUT travels as one archive.
if [ "$(find "$OUT" -type f | wc -l)" -gt 6 ]; then
  tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tgz "$OUT/results.tgz"
fi
