"""``python -m flash_recipe.tools.campaign``: see ``flash_recipe.tools.campaign``."""

import sys

from .cli import main

sys.exit(main())
