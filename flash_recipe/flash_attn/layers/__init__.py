"""``flash_attn.layers`` of the stand-in: only ``flash_attn.layers.rotary`` is provided."""

from __future__ import annotations


def __getattr__(name: str):
    from ...alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("flash_attn.layers", name, ["rotary"])
