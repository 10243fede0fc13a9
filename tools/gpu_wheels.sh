#!/usr/bin/env bash
# For a GPU machine without network access: download, here, the wheels the workspace needs
# beyond what a CUDA image with torch usually has (pydantic, hydra-core and their parts) into
# .whl/ (a git-ignored folder), then copy the repository there and run
#   bash tools/gpu_check.sh --wheels .whl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
py=(--python-version 3.12 --implementation cp)
for spec in pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
            hydra-core==1.3.2 omegaconf==2.3.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: "${py[@]}" "${plat[@]}" -d .whl "$spec"
done
# antlr4's runtime (omegaconf's parser) ships as a source archive only: build its wheel here.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
