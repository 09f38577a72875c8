#!/usr/bin/env bash
# pip install straight from the git repository at a given commit.
set -euo pipefail
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install --index-url "$INDEX_URL" "flash-recipe @ git+$GIT_URL@$GIT_REV"
