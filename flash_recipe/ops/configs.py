"""Launch configurations (block sizes, warps, pipeline stages) per architecture, as data.

A configuration is chosen by ``(arch, kernel, head-dim bucket, element size)``:

- ``arch``: a family of compile targets (``FAMILIES``): ``"sm80"`` (A100: 163 KiB shared memory
  per block), ``"sm86"`` (sm86/sm89, consumer Ampere and Ada: 99 KiB), ``"sm90"`` (Hopper: 227 KiB,
  wgmma), ``"sm100"`` (B200: 227 KiB, tcgen05), ``"sm120"`` (sm120/sm121, RTX 50xx and DGX Spark:
  99 KiB, no wgmma), ``"amd"`` (CDNA gfx90a/gfx942/gfx950, sized for 64 KiB of LDS) or
  ``"interpreter"`` (``TRITON_INTERPRET=1`` on the CPU, where bigger blocks mean fewer programs and
  so less Python overhead). A GPU without a family of its own gets ``FALLBACK_FAMILY``.
- ``kernel``: ``"fwd"`` (the dense forward with plain scores, masks and windows only, at a head
  dim in ``HEAD_DIM_BUCKETS``), ``"fwd_general"`` (the forward with packed sequences, a KV cache's
  key ranges or pages, a softcap, ALiBi, dropout or masked head-dim columns, whose extra registers
  the dense forward's largest tiles cannot hold),
  ``"bwd_dkdv"``, ``"bwd_dq"`` (the deterministic backward's two kernels), ``"bwd_onepass"`` (the
  dK/dV kernel adding dQ with atomics: the default backward, whose dQ tile needs registers of its
  own), ``"decode"`` (the forward kernel on a KV cache with few query rows); and, in the families
  of ``ONE_LAUNCH_FAMILIES`` only, ``"bwd_onelaunch"`` (the one-launch backward, a candidate).
- head-dim bucket: the padded head dim, a power of two from 16 to 256 (``HEAD_DIM_BUCKETS``).
- element size: 2 for fp16/bf16, 4 for fp32 (fp32 tiles need twice the shared memory).

The table (``_TABLE``) is one literal, every family and kernel written out: a row is ``(max
bucket, max element size, Config)``, and the first row that covers the call wins. Each row says
in a line why it differs from its neighbours; docs/performance.md ("Where the table's tiles come
from") gives the measurements behind them. Every entry is compiled for its targets, as a launch
compiles it, by ``nox -s compile_check`` (``devtools.compile_check``), which checks each
kernel against ``SHARED_MEMORY_LIMIT``.

Which configuration a launch on a device takes (an override, a tuned entry, else this table) is
``flash_recipe.ops.choose``; the device's compile target is ``flash_recipe.ops.targets``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .limits import HEAD_DIM_BUCKETS

# Shared memory one block may use (the opt-in maximum), in bytes, per compile target. Sources:
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (sm80 163 KiB,
# sm86/sm89 99 KiB, sm90 227 KiB); CUTLASS ``sm100_smem_capacity_bytes`` (227 KiB) and
# ``sm120_smem_capacity_bytes`` (99 KiB, also reported by devices in flashinfer#3568 and
# cutlass#2692; the GB10 of DGX Spark, sm121, is the same design); AMD CDNA2/CDNA3 ISA guides (64 KiB
# LDS per workgroup) and the CDNA4 ISA guide (160 KiB LDS on gfx950).
SHARED_MEMORY_LIMIT = {
    "sm80": 166912,
    "sm86": 101376,
    "sm89": 101376,
    "sm90": 232448,
    "sm100": 232448,
    "sm120": 101376,
    "sm121": 101376,
    "gfx90a": 65536,
    "gfx942": 65536,
    "gfx950": 163840,
}


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


KERNELS = ("fwd", "fwd_general", "bwd_dkdv", "bwd_dq", "bwd_onepass", "decode")  # every family has rows
# The one-launch backward (``ops.backward_one_launch``): a candidate that ``flash-recipe tune`` and
# the campaign's shoot-out time against the other paths, the default of no family until a GPU
# measures it faster; rows only in these families, at fp16/bf16 and head dims up to 128.
ONE_LAUNCH = "bwd_onelaunch"
ONE_LAUNCH_FAMILIES = ("sm80", "sm86", "sm90", "sm100", "sm120", "interpreter")
ARCHS = ("sm80", "sm86", "sm90", "sm100", "sm120", "amd", "interpreter")

Rows = tuple[tuple[int, int, Config], ...]  # (max head-dim bucket, max element size, Config)

# Each row's comment gives the reason its tile was chosen; the compile check prints what each tile
# compiles to (registers, spills, shared memory):
# ``python -m devtools.compile_check --target <target> --call <call>``.
# Blocks of rows that more than one family or kernel takes, named once. The first row that covers a
# call wins.
_SM80_FWD: Rows = (  # sm80's forward, the general forward's too: its tiles hold the extra registers
    (32, 2, Config(128, 64, 8, 2)),  # 4 warps, or 3 stages, spill at head dim 32
    (64, 2, Config(128, 64, 4, 3)),
    (128, 2, Config(128, 64, 8, 3)),
    (256, 2, Config(64, 64, 4, 2)),
    (64, 4, Config(64, 64, 4, 2)),
    (128, 4, Config(64, 32, 4, 2)),
    (256, 4, Config(32, 32, 4, 1)),
)
_DECODE: Rows = (  # sm80, sm90, sm100: 16 query rows (the smallest mma tile), long key blocks
    (64, 2, Config(16, 128, 4, 3)),
    (128, 2, Config(16, 64, 4, 3)),
    (256, 2, Config(16, 64, 4, 2)),
    (64, 4, Config(16, 64, 4, 2)),
    (128, 4, Config(16, 32, 4, 2)),
    (256, 4, Config(16, 32, 4, 1)),
)
# sm86/sm89 and sm120/sm121: 99 KiB, mma.sync, no wgmma (the compile check proves each target itself).
_SM86: dict[str, Rows] = {
    "fwd": (
        (64, 2, Config(128, 64, 8, 2)),
        (128, 2, Config(64, 64, 4, 2)),
        (256, 2, Config(64, 32, 4, 1)),
        (64, 4, Config(64, 32, 4, 2)),
        (128, 4, Config(32, 32, 4, 2)),
        (256, 4, Config(32, 16, 4, 1)),
    ),
    "fwd_general": (  # as fwd but at head dim 128
        (64, 2, Config(128, 64, 8, 2)),
        (128, 2, Config(32, 64, 4, 2)),  # 64x64 spills with varlen, pages or score options
        (256, 2, Config(64, 32, 4, 1)),
        (64, 4, Config(64, 32, 4, 2)),
        (128, 4, Config(32, 32, 4, 2)),
        (256, 4, Config(32, 16, 4, 1)),
    ),
    "bwd_dkdv": (
        (64, 2, Config(32, 64, 4, 2)),
        (128, 2, Config(32, 64, 4, 1)),
        (256, 2, Config(16, 32, 4, 1)),
        (64, 4, Config(32, 32, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ),
    "bwd_dq": (
        (32, 2, Config(64, 32, 4, 1)),  # 64-key blocks spill at head dim 16, 2 stages at 32
        (64, 2, Config(64, 64, 4, 2)),
        (128, 2, Config(64, 32, 4, 1)),
        (256, 2, Config(32, 32, 4, 1)),
        (64, 4, Config(32, 32, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ),
    "bwd_onepass": (  # as bwd_dkdv but at head dim 128
        (64, 2, Config(32, 64, 4, 2)),
        (128, 2, Config(32, 32, 4, 2)),  # dK/dV's 32x64 spills beside the dQ tile
        (256, 2, Config(16, 32, 4, 1)),
        (64, 4, Config(32, 32, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ),
    "decode": (
        (16, 2, Config(16, 64, 4, 2)),  # 128-key blocks spill at head dim 16 with pages
        (64, 2, Config(16, 128, 4, 2)),
        (128, 2, Config(16, 64, 4, 2)),
        (256, 2, Config(16, 32, 4, 2)),
        (64, 4, Config(16, 64, 4, 2)),
        (128, 4, Config(16, 32, 4, 2)),
        (256, 4, Config(16, 16, 4, 2)),
    ),
}
# Hopper: 227 KiB, wgmma.
_SM90: dict[str, Rows] = {
    "fwd": (
        (64, 2, Config(128, 64, 4, 3)),
        (128, 2, Config(128, 128, 8, 3)),  # wgmma m64n128 per warp group; K/V through TMA (ops.features)
        (256, 2, Config(64, 64, 4, 2)),
        (64, 4, Config(64, 64, 4, 2)),
        (128, 4, Config(64, 32, 4, 2)),
        (256, 4, Config(32, 32, 4, 1)),
    ),
    "fwd_general": (  # as fwd but at head dims 64 and 128
        (64, 2, Config(128, 64, 8, 3)),  # 4 warps spill with packed sequences
        (128, 2, Config(128, 64, 8, 3)),  # 128x128 is proven for plain scores only
        (256, 2, Config(64, 64, 4, 2)),
        (64, 4, Config(64, 64, 4, 2)),
        (128, 4, Config(64, 32, 4, 2)),
        (256, 4, Config(32, 32, 4, 1)),
    ),
    "bwd_dkdv": (
        (64, 2, Config(64, 128, 8, 2)),
        (128, 2, Config(32, 128, 8, 2)),
        (256, 2, Config(32, 64, 8, 1)),
        (128, 4, Config(32, 64, 4, 1)),
        (256, 4, Config(16, 32, 4, 1)),
    ),
    "bwd_dq": (
        (64, 2, Config(128, 64, 8, 2)),
        (128, 2, Config(128, 64, 8, 2)),
        (256, 2, Config(64, 32, 4, 1)),
        (128, 4, Config(64, 32, 4, 1)),
        (256, 4, Config(32, 16, 4, 1)),
    ),
    "bwd_onepass": (  # as bwd_dkdv but at head dim 128
        (64, 2, Config(64, 128, 8, 2)),
        (128, 2, Config(32, 128, 8, 1)),  # 1 stage: 2 stages spill with sinks; Triton >= 3.4 only
        (256, 2, Config(32, 64, 8, 1)),
        (128, 4, Config(32, 64, 4, 1)),
        (256, 4, Config(16, 32, 4, 1)),
    ),
    "decode": _DECODE,
    # The one-launch backward, Config(key step, key block = the dQ programs' rows, ...): torch's
    # default for FlexAttention's backward on sm90 at head dims 64 to 128 (``get_flex_attn_bwd_configs``,
    # torch 2.13: M1/N1/M2/N2 64/128/128/64, 8 warps, 3 stages), which compiles without spills under
    # Triton 3.6 and 3.9 (``--call one_launch``: 243-255 registers at 128, MHA and GQA, with and
    # without sinks) since the backward reads dO and V through Q's and K's strides
    # (``backward_launch.shared_layout``) and pipelines its unmasked loops only.
    ONE_LAUNCH: (
        (64, 2, Config(64, 128, 8, 3)),
        (128, 2, Config(64, 128, 8, 3)),
    ),
}
_AMD_FWD: Rows = (
    (128, 2, Config(64, 64, 4, 1)),
    (256, 2, Config(64, 32, 4, 1)),
    (64, 4, Config(64, 32, 4, 1)),
    (256, 4, Config(32, 16, 4, 1)),
)
_AMD_BWD_DKDV: Rows = (
    (64, 2, Config(32, 64, 4, 1)),
    (128, 2, Config(32, 32, 4, 1)),
    (256, 2, Config(16, 32, 4, 1)),
    (64, 4, Config(32, 32, 4, 1)),
    (256, 4, Config(16, 16, 4, 1)),
)
_INTERPRETER: Rows = ((256, 4, Config(32, 32, 1, 1)),)  # large blocks keep the (slow, Python-level) programs few

# family -> kernel -> rows.
_FAMILY_ROWS: dict[str, dict[str, Rows]] = {
    # sm80 (A100, 163 KiB, mma.sync)
    "sm80": {
        "fwd": _SM80_FWD,
        "fwd_general": _SM80_FWD,
        "bwd_dkdv": (
            (64, 2, Config(64, 128, 8, 2)),
            (128, 2, Config(64, 64, 8, 2)),
            (256, 2, Config(32, 64, 8, 1)),
            (128, 4, Config(32, 64, 4, 1)),
            (256, 4, Config(16, 32, 4, 1)),
        ),
        "bwd_dq": (
            (64, 2, Config(128, 64, 8, 2)),
            (128, 2, Config(128, 32, 8, 2)),
            (256, 2, Config(64, 32, 4, 1)),
            (128, 4, Config(64, 32, 4, 1)),
            (256, 4, Config(32, 16, 4, 1)),
        ),
        "bwd_onepass": (  # as bwd_dkdv, where those tiles hold the dQ tile too
            (64, 2, Config(32, 128, 8, 2)),  # dK/dV's 64x128 spills beside the dQ tile
            (128, 2, Config(64, 64, 8, 2)),  # 2 stages: 1 stage spills with packed sequences
            (256, 2, Config(32, 64, 8, 1)),
            (128, 4, Config(32, 64, 4, 1)),
            (256, 4, Config(16, 32, 4, 1)),
        ),
        "decode": _DECODE,
        # torch's FlexAttention default on sm8x (64/64/64/64, 4 warps, 2 stages) spills with GQA at
        # head dim 64 (32-query steps do not, under Triton 3.6 and 3.9) and at 128 with 4 warps (8 do not)
        ONE_LAUNCH: (
            (64, 2, Config(32, 64, 4, 2)),
            (128, 2, Config(64, 64, 8, 2)),
        ),
    },
    "sm86": {
        **_SM86,
        # FlexAttention's sm86 default (64/64/64/64, 4 warps; 2 stages at head dim 64, 3 at 128): 2 stages
        # spill at 64 (3 do not); at 128 its 3 stages need 105 KiB and 4 warps spill (8 warps, 2 stages do not)
        ONE_LAUNCH: (
            (64, 2, Config(64, 64, 4, 3)),
            (128, 2, Config(64, 64, 8, 2)),
        ),
    },
    "sm120": {
        **_SM86,
        # FlexAttention's sm12x default (64/64/64/64, 4 warps; 2 stages at head dim 64, 1 at 128) spills
        # with GQA at 64 (32-query steps do not) and at 128 with 4 warps (8 warps, 2 stages do not)
        ONE_LAUNCH: (
            (64, 2, Config(32, 64, 4, 2)),
            (128, 2, Config(64, 64, 8, 2)),
        ),
    },
    "sm90": _SM90,
    # sm100 (B200, 227 KiB, tcgen05): Hopper's tiles except where they spill or trap
    "sm100": {
        **_SM90,
        "bwd_dkdv": (
            (64, 2, Config(64, 128, 8, 2)),
            (128, 2, Config(64, 128, 8, 1)),  # Hopper's 32x128 spills; 64 rows do not, and issue less per element
            (256, 2, Config(32, 32, 4, 1)),  # 64-key blocks compile to a trap
            (128, 4, Config(32, 64, 4, 1)),
            (256, 4, Config(16, 32, 4, 1)),
        ),
        "bwd_onepass": (
            (64, 2, Config(64, 128, 8, 2)),
            (128, 2, Config(32, 128, 8, 1)),  # Hopper's one-pass tile, and its Triton >= 3.4 rule
            (256, 2, Config(32, 32, 4, 1)),  # the same trap as bwd_dkdv
            (128, 4, Config(32, 64, 4, 1)),
            (256, 4, Config(16, 32, 4, 1)),
        ),
        # torch's FlexAttention default on sm100 (64/128/128/64, 4 warps, 3 stages) spills here (80-408 B
        # at head dim 128); with 8 warps it does not
        ONE_LAUNCH: (
            (64, 2, Config(64, 128, 8, 3)),
            (128, 2, Config(64, 128, 8, 3)),
        ),
    },
    # amd (CDNA: 64-wide wavefronts, 64 KiB LDS, one stage: no software pipelining needed)
    "amd": {
        "fwd": _AMD_FWD,
        "fwd_general": _AMD_FWD,
        "bwd_dkdv": _AMD_BWD_DKDV,
        "bwd_dq": (
            (64, 2, Config(64, 32, 4, 1)),
            (128, 2, Config(32, 32, 4, 1)),
            (256, 2, Config(32, 16, 4, 1)),
            (64, 4, Config(32, 32, 4, 1)),
            (256, 4, Config(16, 16, 4, 1)),
        ),
        "bwd_onepass": _AMD_BWD_DKDV,
        "decode": (
            (128, 2, Config(16, 64, 4, 1)),
            (256, 2, Config(16, 32, 4, 1)),
            (64, 4, Config(16, 64, 4, 1)),
            (256, 4, Config(16, 16, 4, 1)),
        ),
    },
    "interpreter": {
        "fwd": _INTERPRETER,
        "fwd_general": _INTERPRETER,
        "bwd_dkdv": _INTERPRETER,
        "bwd_dq": _INTERPRETER,
        "bwd_onepass": _INTERPRETER,
        "decode": ((256, 4, Config(16, 32, 1, 1)),),
        ONE_LAUNCH: _INTERPRETER,
    },
}
# (family, kernel) -> rows: the lookup's view of the blocks above.
_TABLE: dict[tuple[str, str], Rows] = {
    (family, kernel): rows for family, kernels in _FAMILY_ROWS.items() for kernel, rows in kernels.items()
}

# The Triton releases that compile the one-pass backward's tile at (family, head-dim bucket)
# without spills (each release from 3.2 to 3.9 checked, 2026-12-04; 3.2's ptxas has no sm100):
# ``python -m devtools.compile_check --call one_pass
# --target sm90 --target sm100 --dtype bfloat16 --head-dim 128 --form aligned`` (MHA and GQA, with
# and without attention sinks) prints the installed release's registers and spills. Under the
# releases that spill it, no other wgmma tile tried compiles without spills either. A release newer
# than the newest listed is taken to compile it cleanly too. Under any other release the backward
# runs the three kernels (``choose.one_pass_fits``); a pair not listed runs the one pass under every
# release. sm100 takes Hopper's tile, its releases checked for sm100 itself.
ONE_PASS_TRITON = {
    ("sm90", 128): ((3, 4), (3, 5), (3, 9)),
    ("sm100", 128): ((3, 3), (3, 4), (3, 5), (3, 6), (3, 7), (3, 8), (3, 9)),
}

# The defaults of ``BACKWARD_PATHS`` that a GPU measured, which win over the instruction counts:
# (target, head-dim bucket) -> (the faster path, the measurement: GPU, Triton, date, each path's speed), whose
# tables and command are in docs/performance.md. Every other default is the proxy's
# (``devtools.backward_paths``); a GPU model's shipped measured file (``tuned.MEASURED_DIR``) or the
# user's ``flash-recipe tune`` file overrides either for that model.
MEASURED_BACKWARD_PATHS = {
    ("sm90", 128): ("three_kernels", "H200, Triton 3.6, bf16, 16 heads, 16k tokens: the three kernels 276-322 "
                                     "TFLOP/s (2026-11-27), the one pass 247-286 (2026-11-28, 48a30fd)"),
}

# The backward each family runs unless a call is deterministic (``choose.backward_path``), by
# head-dim bucket: "one_pass" (the dK/dV kernel adds dQ with atomic adds: 5 products per block
# pair) or "three_kernels" (a dQ kernel, then dK/dV: 7). Each is the path whose main loops issue
# fewer warp-instructions per score element, averaged over MHA and GQA, in the compile check
# (bf16, aligned; ``python -m devtools.backward_paths``, its table in docs/performance.md, which a
# test pins to these), until a GPU measures otherwise (``flash-recipe tune`` keeps the faster per
# GPU model). AMD's family shares its tiles across three generations of matrix cores that do not
# agree (CDNA2's and CDNA4's three kernels issue fewer at head dims 128 and 256, CDNA3's one pass):
# each AMD target has its row, and one the tables do not know takes gfx942's ("amd"). The
# interpreter runs the one pass (its tests cover both paths).
_ONE_PASS = dict.fromkeys(HEAD_DIM_BUCKETS, "one_pass")
_THREE = "three_kernels"
BACKWARD_PATHS: dict[str, dict[int, str]] = {
    # mma.sync families at head dims of 64 and more: the one-pass tiles, which hold the dQ tile's
    # registers too, are smaller, and issue more per element than the two kernels' 7 products
    "sm80": {**_ONE_PASS, 64: _THREE, 128: _THREE, 256: _THREE},
    # but where the three kernels spill with packed sequences (``devtools.backward_paths.SPILLING``)
    "sm86": {**_ONE_PASS, 128: _THREE, 256: _THREE},
    # at 128 what a GPU measured faster (``MEASURED_BACKWARD_PATHS``)
    "sm90": {**_ONE_PASS, 128: MEASURED_BACKWARD_PATHS[("sm90", 128)][0], 256: _THREE},
    "sm100": {**_ONE_PASS, 256: _THREE},
    "sm120": {**_ONE_PASS, 128: _THREE, 256: _THREE},
    "amd": _ONE_PASS,  # gfx942, and AMD targets the tables do not know
    "gfx90a": {**_ONE_PASS, 128: _THREE, 256: _THREE},
    "gfx950": {**_ONE_PASS, 128: _THREE, 256: _THREE},
    "interpreter": _ONE_PASS,
}

# The fewest rows (the product's M) the fast matrix instruction of a family takes: Hopper's wgmma
# and Blackwell's tcgen05 take 64 (a warpgroup's), and below that Triton falls back to Ampere's
# mma.sync, at a fraction of their rate. The one-pass backward computes dQ transposed (its M the
# head dim) where its query tile has fewer rows (``backward_launch.plan_backward``). Other
# families' instructions take 16 rows, and there the transposed product only costs registers
# (it spills on sm86/sm120 at head dim 128). The interpreter takes Hopper's rule, so that the
# CPU tests run the transposed product at head dims of 64 and more, and the direct one below.
MMA_MIN_ROWS = {"sm90": 64, "sm100": 64, "interpreter": 64}

# Compile targets with a table of their own, and the table each uses.
FAMILIES = {
    "sm80": "sm80", "sm86": "sm86", "sm89": "sm86", "sm90": "sm90", "sm100": "sm100",
    "sm120": "sm120", "sm121": "sm120", "gfx90a": "amd", "gfx942": "amd", "gfx950": "amd",
}
# The shared memory each family's configurations are sized for (the least among its targets): a GPU
# must offer at least this much per block. An architecture the tables do not know gets the family
# sized for the least memory among its vendor's supported GPUs.
FAMILY_SHARED_MEMORY = {family: min(SHARED_MEMORY_LIMIT[t] for t, f in FAMILIES.items() if f == family)
                        for family in set(FAMILIES.values())}
FALLBACK_FAMILY = {"cuda": "sm86", "hip": "amd"}


def arch_family(target: str) -> str:
    """Map a compile target (``"sm89"``, ``"sm121"``, ``"gfx942"``, ``"interpreter"``) to a table key.

    A target the tables do not know gets the vendor's most conservative family
    (``FALLBACK_FAMILY``), never a neighbour's larger tiles; NVIDIA GPUs below sm80 and AMD GPUs
    other than CDNA (gfx9xx) are refused with a ValueError.
    """
    if target == "interpreter" or target in FAMILIES:
        return FAMILIES.get(target, target)
    if target.startswith("gfx9"):
        return FALLBACK_FAMILY["hip"]
    if target.startswith("gfx"):
        raise ValueError(
            f"target must be an AMD CDNA GPU (gfx9xx, with matrix cores) for the Triton kernels, got {target}")
    if not target.startswith("sm") or not target[2:].isdigit():
        raise ValueError(f"target must look like 'sm80', 'gfx942' or 'interpreter', got {target!r}")
    if int(target[2:]) < 80:
        raise ValueError(
            f"target must be sm80 or newer for the Triton kernels (tensor cores through mma), got {target}")
    return FALLBACK_FAMILY["cuda"]


def shared_memory_problem(target: str, available: int) -> Optional[str]:
    """Why ``target``'s configurations cannot run on a GPU offering ``available`` bytes of shared
    memory per block, or None when they fit."""
    family = arch_family(target)
    needed = FAMILY_SHARED_MEMORY.get(family)
    if needed is None or available >= needed:
        return None
    return (f"{target} offers {available} bytes of shared memory per block; flash_recipe's configurations for it "
            f"({family}) are sized for {needed}")


def release_takes_one_pass(family: str, bucket: int, release: tuple) -> bool:
    """Whether Triton ``release`` (``(major, minor)``) compiles the one-pass backward's tile for
    ``family`` at head-dim bucket ``bucket`` without spilling (``ONE_PASS_TRITON``)."""
    releases = ONE_PASS_TRITON.get((family, bucket))
    if releases is None:
        return True
    return release in releases or (bool(releases) and release > max(releases))


def backward_path(target: str, head_dim: int) -> str:
    """The backward ``target`` runs by default at ``head_dim``'s bucket (``BACKWARD_PATHS``: the
    target's own row where it has one, else its family's)."""
    paths = BACKWARD_PATHS.get(target) or BACKWARD_PATHS[arch_family(target)]
    return paths[head_dim_bucket(head_dim)]


def head_dim_bucket(head_dim: int) -> int:
    """The padded head dim a kernel is compiled for: the next power of two, at least the smallest
    of ``HEAD_DIM_BUCKETS`` (16)."""
    bucket = HEAD_DIM_BUCKETS[0]
    while bucket < head_dim:
        bucket *= 2
    return bucket


def has_config(target: str, kernel: str, head_dim: int, element_size: int) -> bool:
    """Whether the table has a row for the call (every family has one for each of ``KERNELS``; the
    one-launch backward's families, for fp16/bf16 up to head dim 128)."""
    bucket = head_dim_bucket(head_dim)
    rows = _TABLE.get((arch_family(target), kernel), ())
    return any(bucket <= max_bucket and element_size <= max_size for max_bucket, max_size, _ in rows)


def get_config(target: str, kernel: str, head_dim: int, element_size: int) -> Config:
    """Look up the launch configuration; ``head_dim`` may be unpadded (59 uses the 64 bucket)."""
    if kernel not in KERNELS + (ONE_LAUNCH,):
        raise ValueError(f"kernel must be one of {KERNELS + (ONE_LAUNCH,)}, got {kernel!r}")
    bucket = head_dim_bucket(head_dim)
    for max_bucket, max_size, config in _TABLE.get((arch_family(target), kernel), ()):
        if bucket <= max_bucket and element_size <= max_size:
            return config
    raise ValueError(
        f"no launch configuration for head dim {head_dim} with {element_size}-byte elements on {target}"
    )
