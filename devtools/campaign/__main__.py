"""``python -m devtools.campaign``: see ``devtools.campaign``."""

import sys

from .cli import main

sys.exit(main())
