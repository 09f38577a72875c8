#!/usr/bin/env bash
# pip install straight from the git repository, at a branch, tag or commit.
set -euo pipefail
python3 -m venv .venv
.venv/bin/python -m pip install "flash-recipe @ git+https://github.com/flash-recipe/flash-recipe@main"
