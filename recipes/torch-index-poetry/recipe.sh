#!/usr/bin/env bash
# A Poetry project that takes torch from a dedicated torch index and everything else from the
# package index.
set -euo pipefail
poetry init --no-interaction --name consumer --python "~$PYTHON_VERSION"
poetry config --local virtualenvs.in-project true
poetry env use "$PYTHON"
poetry source add --priority=primary index "$INDEX_URL"
poetry source add --priority=explicit torch-index "$TORCH_INDEX_URL"
poetry add --source torch-index "torch==$TORCH_VERSION"
poetry add "flash-recipe==$FLASH_RECIPE_VERSION"
