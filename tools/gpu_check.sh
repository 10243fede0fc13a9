#!/usr/bin/env bash
# The GPU checks, as one prepared command for a lent device machine (`run` with
# carry [".whl"], after tools/gpu_wheels.sh here). It installs the workspace into the image's
# python3 (torch with CUDA is already there), then runs every test marked `gpu`: the
# transport's kernel on CUDA (fp32, bf16), and - where transformer_engine / magi_attention are
# importable - the TE partition cross-check, TE's CP group and the MagiAttention kernel path.
# Writes the log to $OUT/gpu_check.log when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu_check.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    -e packages/cp-core -e packages/cp-te -e packages/cp-magi -e packages/cp-blockdiag
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  PYTHONUNBUFFERED=1 python3 -m pytest -m gpu -rs -q -p no:cacheprovider \
    packages/cp-core/tests packages/cp-te/tests packages/cp-magi/tests
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
