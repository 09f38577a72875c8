#!/usr/bin/env bash
# A Poetry project that depends on flash-recipe at a git commit.
set -euo pipefail
poetry init --no-interaction --name consumer --python "~$PYTHON_VERSION"
poetry config --local virtualenvs.in-project true
poetry env use "$PYTHON"
poetry source add --priority=primary index "$INDEX_URL"
poetry add "git+$GIT_URL#$GIT_REV"
