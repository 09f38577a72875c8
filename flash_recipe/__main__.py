"""``python -m flash_recipe`` is the ``flash-recipe`` command."""

import sys

from .tools.cli import main

sys.exit(main())
