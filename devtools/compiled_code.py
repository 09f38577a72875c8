"""What the compiled code of a kernel says: its registers, spills and stores, the matrix unit its
dots use, and the instructions of its main loop (``devtools.compile_check`` reads each
kernel it compiles through these)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import triton.backends.nvidia

from flash_recipe.tools.compile_calls import resource_usage, stores


def nvidia_usage(kernel) -> dict:
    """Registers and spilled bytes per thread (``compile_calls.resource_usage``), the matrix
    instruction its PTX uses, and the instructions of its main loop (``main_loop`` on
    ``cuobjdump -sass``, the tool Triton ships)."""
    registers, spill_bytes = resource_usage(kernel, amd=False)
    cuobjdump = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    ptx = kernel.asm["ptx"]
    units = dot_units(kernel.asm["ttgir"])
    body = main_loop_body(sass.stdout)
    partitions = len(re.findall(r"^\s*partition\d+\(", kernel.asm["ttgir"], re.MULTILINE))
    softmax = softmax_loop_body(sass.stdout) if partitions else None
    return {
        "registers": registers,
        "spill_bytes": spill_bytes,
        "fma_dots": units.get("fma", 0),
        "sync_dots": units.get("mma.sync", 0),
        "stores": stores(kernel, amd=False),
        "matrix_unit": next((unit for unit in ("tcgen05.mma", "wgmma", "mma.sync") if unit in ptx), None),
        "loop_instructions": len(body) if body is not None else None,  # ``main_loop``, parsed once
        "loop_matrix_macs": loop_matrix_macs(sass.stdout, kernel.metadata.num_warps),
        "loop_hmma": sum(1 for text in body if _HMMA_ANY.search(text)) if body is not None else None,
        "loop_integer_mma": sum(1 for text in body if INTEGER_SASS.search(text)) if body is not None else None,
        "loop_fp8_mma": sum(1 for text in body if FP8_SASS.search(text)) if body is not None else None,
        # warp specialisation: the partitions Triton split the kernel's loop into (0: none), the
        # instructions of the softmax partition's loop (``softmax_loop_body``) and its warps: the
        # launch's ``num_warps`` (``ttg.num-warps``), which Triton gives the softmax partition too
        "warp_partitions": partitions,
        "softmax_loop_instructions": len(softmax) if softmax is not None else None,
        "softmax_warps": _module_warps(kernel.asm["ttgir"]) if partitions else None,
    }


def _module_warps(ttgir: str) -> int:
    """The warps a TTGIR module was compiled for (``"ttg.num-warps"``, Triton 3.2's
    ``"triton_gpu.num-warps"``)."""
    found = re.search(r'"(?:ttg|triton_gpu)\.num-warps" = (\d+)', ttgir)
    if found is None:
        raise RuntimeError("the TTGIR names no num-warps")
    return int(found.group(1))


# The matrix instructions: fp16/bf16 (``HMMA``, ``HGMMA``, ``UTCHMMA``), int8 (``IMMA``, ``IGMMA``,
# ``UTCIMMA``) and FP8 (``QMMA``, ``QGMMA``, ``UTCQMMA``), per warp, per warpgroup (sm90) and
# through the tensor memory (sm100).
_MATRIX_SASS = re.compile(r"\b(UTC\w*MMA|[HIQ]GMMA|[HIQ]MMA)\b")
INTEGER_SASS = re.compile(r"\b(IMMA|IGMMA|UTCIMMA)\b")
FP8_SASS = re.compile(r"\b(QMMA|QGMMA|UTCQMMA)\b")
# A branch and its target address: ``@!P0 BRA 0x1370``, ``BRA.U !UP0, 0x17a0``, ``BRA `(.L_x_3) 0x90``.
_BRANCH = re.compile(r"(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:!?U?P\w+\s*,\s*)?(?:`?\(?\.L_x_\d+\)?\s*)?0x([0-9a-f]+)")


def main_loop(sass: str) -> Optional[int]:
    """Instructions in one iteration of the main loop of a disassembled kernel (``cuobjdump -sass``),
    or None for a kernel without a loop of matrix instructions (see ``main_loop_body``)."""
    body = main_loop_body(sass)
    return len(body) if body is not None else None


# Matrix instructions and their shapes: ``HMMA.16816.F32.BF16`` (one warp: m16 n8 k16; int8's
# ``IMMA.16832`` and FP8's ``QMMA.16832``: k32), ``HGMMA.64x128x16.F32.BF16`` (one warpgroup of 4
# warps: m64 n128 k16; ``IGMMA``/``QGMMA`` alike).
_HMMA = re.compile(r"\b[HIQ]MMA\.(16)(8)(8|16|32)\b")
_HGMMA = re.compile(r"\b[HIQ]GMMA\.(\d+)x(\d+)x(\d+)\b")


def loop_matrix_macs(sass: str, num_warps: int) -> Optional[int]:
    """Multiply-adds the thread block's matrix instructions do in one main-loop iteration (sm80's
    ``HMMA``, once per warp; sm90's ``HGMMA``, once per warpgroup of 4 warps), or None where the
    loop has other matrix instructions (sm100's ``UTC*MMA``, whose shape the mnemonic does not say)
    or none. Divided by ``BLOCK_M * BLOCK_N * D`` it counts the block-pair products a loop issues."""
    body = main_loop_body(sass)
    if body is None:
        return None
    macs = 0
    for text in body:
        if (found := _HMMA.search(text)) is not None:
            macs += num_warps * int(found.group(1)) * int(found.group(2)) * int(found.group(3))
        elif (found := _HGMMA.search(text)) is not None:
            macs += num_warps // 4 * int(found.group(1)) * int(found.group(2)) * int(found.group(3))
        elif _MATRIX_SASS.search(text):
            return None
    return macs or None


def main_loop_body(sass: str) -> Optional[list]:
    """The instructions of one iteration of the main loop of a disassembled kernel, or None.

    A loop is a branch back to an earlier address from before the kernel's last ``EXIT``; its body
    is every instruction from the target to the branch, NOPs excepted (``loop_bodies``). Of the
    loops that issue matrix instructions, the main loop is the shortest: the kernels' masked stages
    repeat the unmasked loop's work plus their masks.
    """
    bodies = [body for body in loop_bodies(sass) if any(_MATRIX_SASS.search(t) for t in body)]
    return min(bodies, key=len, default=None)


def softmax_loop_body(sass: str) -> Optional[list]:
    """In a warp-specialised kernel, the loop of the partition that takes the softmax: of the loops
    without matrix instructions (those run in a partition of their own), the one with the most
    ``MUFU.EX2``; None where no such loop has one."""
    bodies = [body for body in loop_bodies(sass) if not any(_MATRIX_SASS.search(t) for t in body)]
    best = max(bodies, key=lambda body: sum("MUFU.EX2" in t for t in body), default=None)
    return best if best is not None and any("MUFU.EX2" in t for t in best) else None


def loop_bodies(sass: str) -> list:
    """Every loop of a disassembled kernel (``cuobjdump -sass``): a branch back to an earlier address
    from before the kernel's last ``EXIT``, its body every instruction from the target to the
    branch, NOPs excepted. (Backward branches after the last exit are out-of-line blocks, such as a
    barrier's retry, returning into the code.)"""
    code = [(int(address, 16), text.strip()) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    last_exit = max((a for a, t in code if re.match(r"(@!?U?P\w+\s+)?EXIT\b", t)), default=None)
    bodies = []
    for address, text in code:
        branch = _BRANCH.match(text)
        if branch and int(branch.group(1), 16) < address and (last_exit is None or address < last_exit):
            bodies.append([t for a, t in code if int(branch.group(1), 16) <= a <= address and not t.startswith("NOP")])
    return bodies


# A layout's alias in the TTGIR: ``#mma1 = #ttg.nvidia_mma<{versionMajor = 2, ...}>`` (Triton 3.2
# spells the dialect ``triton_gpu``), ``#blocked = #ttg.blocked<{...}>``, ``#mma = #ttg.amd_mfma<...``.
_LAYOUT = re.compile(r"^#(\w+) = #\w+\.(\w+)<\{([^\n]*)", re.MULTILINE)
_DOT_RESULT = re.compile(r"= tt\.dot .*->\s*tensor<[^>]*?,\s*#(\w+)>")
_HMMA_ANY = re.compile(r"\bHMMA\b")


def dot_units(ttgir: str) -> dict:
    """How many of a kernel's dots each unit runs, from its TTGIR: ``"wgmma"`` (Hopper's
    ``warp_group_dot``), ``"tcgen05"`` (Blackwell's ``tc_gen5_mma``), ``"mma.sync"`` (a ``tt.dot``
    whose result has an ``nvidia_mma`` layout of version 2: Ampere's warp-level instruction, the
    slow path on Hopper and Blackwell), ``"mfma"`` (AMD's matrix cores) and ``"fma"`` (a ``tt.dot``
    left in a ``#blocked`` layout: no matrix unit at all)."""
    kinds = {}
    for name, kind, params in _LAYOUT.findall(ttgir):
        if kind == "nvidia_mma":
            major = re.search(r"versionMajor = (\d+)", params)
            kinds[name] = "mma.sync" if major is not None and int(major.group(1)) < 3 else "wgmma"
        elif kind == "blocked":
            kinds[name] = "fma"
        elif kind.startswith("amd_"):
            kinds[name] = "mfma"
    counts: dict = {}
    for line in ttgir.splitlines():
        if re.search(r"= \w+\.warp_group_dot ", line):
            unit = "wgmma"
        elif re.search(r"\b\w+\.tc_gen5_mma(?:_scaled)? ", line):
            unit = "tcgen05"
        elif (found := _DOT_RESULT.search(line)) is not None:
            unit = kinds.get(found.group(1), found.group(1))
        else:
            continue
        counts[unit] = counts.get(unit, 0) + 1
    return counts


def amd_usage(kernel) -> dict:
    """VGPRs and scratch bytes per work-item (``compile_calls.resource_usage``), and the
    instructions of its main loop (``amd_main_loop_body``). A wavefront issues each instruction
    once, as a warp does: ``loop_instructions x num_warps`` are the wavefront-instructions of one
    iteration."""
    asm = kernel.asm.get("amdgcn", "")
    registers, spill_bytes = resource_usage(kernel, amd=True)
    body = amd_main_loop_body(asm)
    return {
        "registers": registers,
        "spill_bytes": spill_bytes,
        "fma_dots": dot_units(kernel.asm["ttgir"]).get("fma", 0),
        "stores": stores(kernel, amd=True),
        "matrix_unit": "mfma" if "mfma" in asm else None,
        "loop_instructions": len(body) if body is not None else None,
        # int8 products: in the main loop, or the whole kernel's where no loop was found
        "loop_integer_mma": sum(1 for text in (asm.splitlines() if body is None else body) if _MFMA_I8.search(text)),
    }


_MFMA = re.compile(r"\bv_mfma_")
_MFMA_I8 = re.compile(r"\bv_mfma_i32_\w+")
# An instruction line of the AMD assembly (a tab, then the mnemonic); labels, directives (``.loc``)
# and comments are not instructions.
_AMD_INSTRUCTION = re.compile(r"^\t([a-z][a-z0-9_]*)\b")
_AMD_LABEL = re.compile(r"^(\.LBB\d+_\d+):")
_AMD_BRANCH = re.compile(r"^\ts_(?:cbranch_\w+|branch)\s+(\.LBB\d+_\d+)")


def amd_main_loop_body(asm: str) -> Optional[list]:
    """The instructions of one iteration of the main loop of an AMD kernel's assembly (LLVM's
    ``amdgcn`` text), or None: the rule of ``main_loop_body`` on AMD's code. A loop is a branch
    (``s_branch``, ``s_cbranch_*``) back to a label placed earlier, from before the kernel's last
    ``s_endpgm``; its body is every instruction from the label to the branch, ``s_nop`` (hazard
    padding) excepted. Of the loops that issue ``v_mfma`` instructions, the main loop is the
    shortest."""
    labels: dict[str, int] = {}
    code: list[tuple[int, str]] = []  # (line, instruction)
    branches: list[tuple[int, str]] = []  # (line, target label)
    last_end = None
    for number, line in enumerate(asm.splitlines()):
        if (label := _AMD_LABEL.match(line)) is not None:
            labels[label.group(1)] = number
        elif (instruction := _AMD_INSTRUCTION.match(line)) is not None:
            code.append((number, line.strip()))
            if instruction.group(1) == "s_endpgm":
                last_end = number
            if (branch := _AMD_BRANCH.match(line)) is not None:
                branches.append((number, branch.group(1)))
    loops = []
    for number, target in branches:
        start = labels.get(target)
        if start is None or start > number or (last_end is not None and number > last_end):
            continue
        body = [text for at, text in code if start < at <= number and not text.startswith("s_nop")]
        if any(_MFMA.search(text) for text in body):
            loops.append(body)
    return min(loops, key=len, default=None)
