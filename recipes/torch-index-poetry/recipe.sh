#!/usr/bin/env bash
# In a Poetry project: torch from the PyTorch index of your build (here the CPU build),
# everything else from the package index.
set -euo pipefail
poetry source add --priority=explicit pytorch https://download.pytorch.org/whl/cpu
poetry add --source pytorch torch
poetry add flash-recipe
