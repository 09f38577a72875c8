"""Integrations of flash_recipe into other libraries.

Each integration is a submodule that imports its library only when it is used, so importing
``flash_recipe`` (or this package) never imports them:

    flash_recipe.integrations.transformers   ``register()`` adds ``attn_implementation="recipe_attention"``
                                             to Hugging Face transformers (extra: ``flash-recipe[transformers]``)
"""
