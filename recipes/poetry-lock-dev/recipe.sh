#!/usr/bin/env bash
# The project's development environment, exactly as poetry.lock pins it, in a clone.
set -euo pipefail
poetry check --lock
poetry install
