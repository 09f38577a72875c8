#!/usr/bin/env bash
# In a Poetry project: flash-recipe from the package index.
set -euo pipefail
poetry add flash-recipe
