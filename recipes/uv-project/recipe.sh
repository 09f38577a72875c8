#!/usr/bin/env bash
# A uv project that depends on flash-recipe from the package index.
set -euo pipefail
uv init --bare
uv add flash-recipe
