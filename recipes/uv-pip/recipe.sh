#!/usr/bin/env bash
# uv's pip interface: a plain virtual environment, then flash-recipe into it.
set -euo pipefail
uv venv
uv pip install flash-recipe
