#!/usr/bin/env bash
# The GPU checks of this workspace, for a machine with an NVIDIA GPU.
#
#   bash tools/gpu_check.sh [--venv DIR] [--report FILE] [--wheels DIR] [--with-te]
#
# 1. Creates its own virtual environment (default .venv-gpu). It sees the interpreter's own
#    packages, so a CUDA build of torch that is already installed is reused; without one, pip
#    installs torch (on Linux x86-64 the default wheel is a CUDA build).
# 2. Installs every workspace package editable with its test extras; --with-te adds cp-te's
#    `gpu` extra (TransformerEngine's PyTorch extension, a long build where no wheel fits).
#    --wheels DIR installs from a folder of wheels instead of an index (a machine offline).
# 3. Runs every test marked `gpu` (the transport kernel on CUDA in fp32 and bf16, and, where
#    transformer_engine / magi_attention import, TE's partition kernel and CP group and
#    MagiAttention's kernel path), then the device benchmark
#    (tools/bench/bench_kernel_device.py: the kernel against masked SDPA, fp32 and bf16).
# 4. Writes one report (default gpu_check_report.md): the machine, the versions, the tests'
#    summary with their skip reasons, and the benchmark table; its JSON lands beside it.
#
# PYTHON picks the interpreter the environment is made from (default python3); TORCH_SPEC the
# torch requirement installed when none is importable (default "torch"). Exit status:
# 0 when every gpu test passed, 1 when one failed, 2 when no CUDA device is visible.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

venv=".venv-gpu"
report="gpu_check_report.md"
wheels=""
with_te=0
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --report) report="$2"; shift 2 ;;
    --wheels) wheels="$(cd "$2" && pwd)"; shift 2 ;;
    --with-te) with_te=1; shift ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 64 ;;
  esac
done
report="$(cd "$(dirname "$report")" && pwd)/$(basename "$report")"
results="${report%.*}_results"
py="${PYTHON:-python3}"

step() { printf '\n== %s\n' "$*" >&2; }

step "environment $venv (from $("$py" -c 'import sys; print(sys.executable)'))"
[ -x "$venv/bin/python" ] || "$py" -m venv --system-site-packages "$venv" || exit 1
vpy="$venv/bin/python"
pip=("$vpy" -m pip --disable-pip-version-check -q install)
# Offline: wheels from the folder, and what the interpreter already has (build tools included).
[ -n "$wheels" ] && pip+=(--no-index --find-links "$wheels" --no-build-isolation)

if ! "$vpy" -c "import torch" 2>/dev/null; then
  step "installing torch"
  "${pip[@]}" "${TORCH_SPEC:-torch}" || exit 1
fi
mapfile -t members < <("$vpy" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["tool"]["cp-workspace"]["members"]))
PY
)
args=()
for m in "${members[@]}"; do
  extras="test"
  [ "$with_te" = 1 ] && [ "$m" = "packages/cp-te" ] && extras="test,gpu"
  args+=(-e "$m[$extras]")
done
step "installing the workspace: ${members[*]}"
"${pip[@]}" numpy "${args[@]}" || exit 1

mkdir -p "$results"
tests_log="$results/gpu_tests.log"
bench_log="$results/bench.log"
facts="$("$vpy" - <<'PY'
import importlib.util, platform, torch
print(f"- python {platform.python_version()}, torch {torch.__version__}, "
      f"CUDA build {torch.version.cuda}, CUDA available {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"- device {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
for mod in ("transformer_engine", "magi_attention"):
    print(f"- {mod}: {'importable' if importlib.util.find_spec(mod) else 'not installed'}")
PY
)"
cuda="$("$vpy" -c 'import torch; print(int(torch.cuda.is_available()))')"

step "tests marked gpu"
PYTHONUNBUFFERED=1 "$vpy" -m pytest -m gpu -rs -q -p no:cacheprovider \
  packages/*/tests tests 2>&1 | tee "$tests_log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" = 5 ] && tests_rc=0  # no gpu test collected is not a failure of one

bench_rc=0
if [ "$cuda" = 1 ]; then
  step "device benchmark"
  "$vpy" tools/bench/bench_kernel_device.py --device cuda --out "$results" 2>&1 \
    | tee "$bench_log"
  bench_rc=${PIPESTATUS[0]}
else
  echo "no CUDA device visible: the device benchmark did not run" > "$bench_log"
fi

{
  echo "# GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "$facts"
  command -v nvidia-smi >/dev/null && {
    echo; echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo '```'
  }
  echo
  echo "## Tests marked gpu (exit status $tests_rc)"
  echo; echo '```'
  if grep -q "short test summary" "$tests_log"; then
    sed -n '/short test summary/,$p' "$tests_log"
  else
    tail -n 1 "$tests_log"
  fi
  echo '```'
  echo
  echo "## Device benchmark (exit status $bench_rc)"
  echo; echo '```'
  cat "$bench_log"
  echo '```'
  echo
  echo "Full logs and the benchmark's JSON: $results/"
} > "$report"
step "report: $report"

[ "$cuda" = 1 ] || { echo "no CUDA device visible: the gpu tests skipped" >&2; exit 2; }
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] || exit 1
exit 0
