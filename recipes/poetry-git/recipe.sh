#!/usr/bin/env bash
# In a Poetry project: flash-recipe from its git repository, at a branch, tag or commit.
set -euo pipefail
poetry add "git+https://github.com/flash-recipe/flash-recipe#main"
