#!/usr/bin/env bash
# uv's pip interface: a plain virtual environment, then flash-recipe into it.
set -euo pipefail
uv venv --python "$PYTHON" .venv
uv pip install --python .venv --index-url "$INDEX_URL" "flash-recipe==$FLASH_RECIPE_VERSION"
