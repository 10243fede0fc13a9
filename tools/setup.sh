#!/usr/bin/env bash
# Create .venv (idempotent) with torch, numpy and every workspace package editable with its
# test extras. Re-running is cheap: installs are skipped while the package manifests are
# unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
# Members listed in the root pyproject.toml: adding a package is a folder and a line there.
mapfile -t members < <(.venv/bin/python - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["tool"]["cp-workspace"]["members"]))
PY
)
stamp_src="$(cat pyproject.toml "${members[@]/%//pyproject.toml}" tools/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f .venv/.setup-stamp ] && [ "$(cat .venv/.setup-stamp)" = "$stamp_src" ]; then
  exit 0
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # The CPU wheel of this pin is on local disk here; elsewhere fall back to any torch.
  "${pip[@]}" install "torch==2.13.0" || "${pip[@]}" install torch
fi
args=()
for m in "${members[@]}"; do args+=(-e "$m[test]"); done
"${pip[@]}" install numpy "${args[@]}"
echo "$stamp_src" > .venv/.setup-stamp
