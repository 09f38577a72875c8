#!/usr/bin/env bash
# A Poetry project that depends on a local checkout of flash-recipe (built, not linked).
set -euo pipefail
poetry init --no-interaction --name consumer --python "~$PYTHON_VERSION"
poetry config --local virtualenvs.in-project true
poetry env use "$PYTHON"
poetry source add --priority=primary index "$INDEX_URL"
poetry add "$CHECKOUT"
