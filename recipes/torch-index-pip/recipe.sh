#!/usr/bin/env bash
# pip: torch first, from the dedicated torch index, then flash-recipe from the package index.
set -euo pipefail
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install --index-url "$TORCH_INDEX_URL" --no-deps "torch==$TORCH_VERSION"
.venv/bin/python -m pip install --index-url "$INDEX_URL" "flash-recipe==$FLASH_RECIPE_VERSION"
