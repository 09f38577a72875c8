#!/usr/bin/env bash
# Build flash-recipe from its sdist inside an environment that already holds torch, triton and
# the build backend, without an isolated build environment.
set -euo pipefail
python3 -m venv .venv
.venv/bin/python -m pip install torch "triton>=3.2" "poetry-core>=2.0"
.venv/bin/python -m pip install --no-build-isolation --no-binary flash-recipe flash-recipe
