"""``flash_attn.layers`` of the stand-in: only ``flash_attn.layers.rotary`` is provided."""

from __future__ import annotations


def __getattr__(name: str):
    from flash_recipe.alias import missing

    raise missing("flash_attn.layers", name, ["rotary"])
