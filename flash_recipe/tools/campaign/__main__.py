"""``python -m flash_recipe.tools.campaign``: see ``flash_recipe.tools.campaign``."""

import sys

from flash_recipe.tools.campaign.cli import main

sys.exit(main())
