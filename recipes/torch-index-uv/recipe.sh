#!/usr/bin/env bash
# A uv project that takes torch from a dedicated torch index and everything else from the
# package index.
set -euo pipefail
uv init --bare --name consumer --python "$PYTHON"
cat >> pyproject.toml <<TOML

[[tool.uv.index]]
name = "index"
url = "$INDEX_URL"
default = true

[[tool.uv.index]]
name = "torch-index"
url = "$TORCH_INDEX_URL"
explicit = true

[tool.uv.sources]
torch = { index = "torch-index" }
TOML
uv add --python "$PYTHON" "torch==$TORCH_VERSION" "flash-recipe==$FLASH_RECIPE_VERSION"
