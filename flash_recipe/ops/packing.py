"""GQA packing: whether a launch serves a whole GQA group from one query tile per kv head, so that
each key and value block is read once for the group (``gqa_packing``). The forward and the KV-cache
launchers ask it; the kernel's ``PACK_GQA`` flag runs it. The module imports no Triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import choose
from .configs import Config

# A GQA call whose group's query rows (Sq * group) number at most this many runs as one query tile
# per kv head, on the decode configuration's key blocks.
PACK_MAX_ROWS = 64


def gqa_packing(
    device: torch.device, kernel: str, seqlen_q: int, head_dim: int, group: int, dropout_p: float,
    element_size: int, pack_gqa: Optional[bool] = None,
) -> tuple[bool, Config, int]:
    """Whether a launch packs each GQA group into one query tile, with its configuration and block.

    Every program streams all the keys it sees, so a launch reads each kv head's keys once per
    query tile that uses that kv head: ``group * cdiv(Sq, BLOCK_M)`` tiles unpacked,
    ``cdiv(Sq * group, BLOCK_M)`` packed. The rule: with GQA (``group > 1``) and no dropout,

    - a short query (``Sq * group <= PACK_MAX_ROWS``: decoding, speculative decoding, a small
      chunk) packs into a single tile per kv head: the ``"decode"`` configuration, its query block
      raised to the next power of two of ``Sq * group``, so every key is read once;
    - a longer one packs only where that needs fewer tiles than unpacked with the same block.

    Returns ``(pack, config, block_m)``: the launch configuration of ``kernel`` (``"decode"``'s for
    a short packed query) and the query block to launch with. ``pack_gqa=False`` never packs.
    """
    rows = seqlen_q * group
    packable = pack_gqa is not False and group > 1 and dropout_p == 0.0
    if packable and rows <= PACK_MAX_ROWS:
        cfg = choose.launch_config(device, "decode", head_dim, element_size)
        return True, cfg, max(cfg.block_m, 1 << max(rows - 1, 0).bit_length())
    cfg = choose.launch_config(device, kernel, head_dim, element_size)
    pack = packable and -(-rows // cfg.block_m) < group * -(-seqlen_q // cfg.block_m)
    return pack, cfg, cfg.block_m

