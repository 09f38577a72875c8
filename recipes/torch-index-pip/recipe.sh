#!/usr/bin/env bash
# pip: torch first, from the PyTorch index of your build (here the CPU build), then flash-recipe
# from the package index.
set -euo pipefail
python3 -m venv .venv
.venv/bin/python -m pip install --index-url https://download.pytorch.org/whl/cpu --no-deps torch
.venv/bin/python -m pip install flash-recipe
