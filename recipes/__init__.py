"""flash-recipe's install recipes and the machinery that runs them (``recipes.harness``)."""
