#!/usr/bin/env bash
# The project's development environment, exactly as poetry.lock pins it, run in a checkout.
set -euo pipefail
poetry check --lock
poetry config --local virtualenvs.in-project true
poetry env use "$PYTHON"
poetry install
