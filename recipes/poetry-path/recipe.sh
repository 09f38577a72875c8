#!/usr/bin/env bash
# In a Poetry project: flash-recipe from a local clone (built and installed, not linked).
set -euo pipefail
git clone https://github.com/flash-recipe/flash-recipe
poetry add ./flash-recipe
