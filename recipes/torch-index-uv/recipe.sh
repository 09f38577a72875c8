#!/usr/bin/env bash
# A uv project that takes torch from the PyTorch index of your build (here the CPU build) and
# everything else from the package index.
set -euo pipefail
uv init --bare
cat >> pyproject.toml <<'TOML'

[[tool.uv.index]]
name = "pytorch"
url = "https://download.pytorch.org/whl/cpu"
explicit = true

[tool.uv.sources]
torch = { index = "pytorch" }
TOML
uv add torch flash-recipe
