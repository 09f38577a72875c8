"""The source Inductor regenerates for a Triton kernel that torch.compile traces, and the global
names it lacks. Imported in a process without ``TRITON_INTERPRET`` (``offline.compile_in_subprocess``):
Inductor reads the source of compiled-mode jit functions.

torch.compile traces a launch made outside the custom ops (a KV-cache step, paged keys) down to the
kernel, and Inductor recompiles the kernel from source it writes itself: the kernel's own, the jit
functions it names (found through its globals, transitively), and its imports of ``triton`` and
``tl``. A name reached through anything else (``tiles.load_tile``) is undefined there, which shows
only on a GPU, as a NameError when the kernel compiles.
"""

from __future__ import annotations

import builtins
import dis
import importlib.util
import os
import tempfile

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from flash_recipe.ops import tiles


def missing_names(kernels: dict) -> dict:
    """For each kernel (name -> jit function), the ``"function: name"`` globals its regenerated
    source lacks; ``{"skipped": reason}`` where this torch cannot regenerate it."""
    try:
        from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
    except ImportError as exc:
        return {"skipped": f"this torch's Inductor regenerates no kernel source here ({exc})"}
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, kernel in kernels.items():
            kernel = getattr(kernel, "fn", kernel) if not isinstance(kernel, JITFunction) else kernel
            source = user_defined_triton_kernel_transitive_closure_source_code(kernel)
            path = os.path.join(folder, f"regenerated_{name}.py")
            with open(path, "w") as f:  # Inductor's prelude, its decorator, then the closure
                f.write("import triton\nimport triton.language as tl\n\n@triton.jit\n" + source + "\n")
            spec = importlib.util.spec_from_file_location(f"regenerated_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            space = vars(module)
            found[name] = [
                f"{value.__name__}: {inst.argval}"
                for value in list(space.values())
                if isinstance(value, JITFunction)
                for inst in dis.Bytecode(value.fn)
                if inst.opname == "LOAD_GLOBAL" and inst.argval not in space and not hasattr(builtins, inst.argval)
            ]
    return found


@triton.jit
def through_module_kernel(X, BLOCK: tl.constexpr):
    """A planted kernel that reaches a constant through its module (``tiles.LOG2E``)."""
    o = tl.arange(0, BLOCK)
    tl.store(X + o, tl.load(X + o) * tiles.LOG2E)
