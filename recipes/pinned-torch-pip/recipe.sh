#!/usr/bin/env bash
# A pip project whose requirements.txt pins torch (installed in .venv) adds flash-recipe; its
# torch stays as it was.
set -euo pipefail
echo "flash-recipe" >> requirements.txt
.venv/bin/python -m pip install -r requirements.txt
