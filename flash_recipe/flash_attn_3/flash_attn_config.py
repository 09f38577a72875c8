"""``flash_attn_config`` of the FlashAttention-3 stand-in: FA3's build configuration, read by code
that asks which head dims and features a build left out. A flag is True where flash_recipe's
stand-in refuses what it switches off: FP8, and a value head dim other than the query's (the
``HDIMDIFF`` builds); every other one is False."""

from __future__ import annotations

# The FLASHATTENTION_DISABLE_* switches of FA3's setup.py: head dims, dtypes and features a build may omit.
_FEATURES = (
    "BACKWARD",
    "SPLIT",
    "PAGEDKV",
    "APPENDKV",
    "LOCAL",
    "SOFTCAP",
    "PACKGQA",
    "FP16",
    "FP8",
    "VARLEN",
    "CLUSTER",
    "HDIM64",
    "HDIM96",
    "HDIM128",
    "HDIM192",
    "HDIM256",
    "HDIMDIFF64",
    "HDIMDIFF192",
    "SM8x",
)
_NOT_PROVIDED = ("FP8", "HDIMDIFF64", "HDIMDIFF192")

CONFIG = {"build_flags": {f"FLASHATTENTION_DISABLE_{feature}": feature in _NOT_PROVIDED for feature in _FEATURES}}
