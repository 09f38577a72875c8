#!/usr/bin/env bash
# A uv project that depends on flash-recipe from a package index.
set -euo pipefail
uv init --bare --name consumer --python "$PYTHON"
cat >> pyproject.toml <<TOML

[[tool.uv.index]]
name = "index"
url = "$INDEX_URL"
default = true
TOML
uv add --python "$PYTHON" "flash-recipe==$FLASH_RECIPE_VERSION"
