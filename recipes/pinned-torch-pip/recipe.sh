#!/usr/bin/env bash
# An existing pip project whose requirements pin torch adds flash-recipe; its torch stays as it was.
set -euo pipefail
"$PYTHON" -m venv .venv
echo "torch==$TORCH_VERSION" > requirements.txt
.venv/bin/python -m pip install --index-url "$INDEX_URL" -r requirements.txt
echo "flash-recipe==$FLASH_RECIPE_VERSION" >> requirements.txt
.venv/bin/python -m pip install --index-url "$INDEX_URL" -r requirements.txt
