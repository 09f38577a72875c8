"""``python -m flash_recipe.campaign --out DIR``: the GPU campaign's entry point.

The campaign itself is ``flash_recipe.tools.campaign`` (its docstring says what it runs); this
module only keeps the short command that the docs and GPU machines use.
"""

from __future__ import annotations

if __name__ == "__main__":
    import sys

    from .tools.campaign.cli import main

    sys.exit(main())
