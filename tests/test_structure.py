"""The package's shape: no import cycle, every import of the package relative, imports of the package
at the top of their files unless a comment says why not, kernels launched by keyword and only
through ``flash_recipe.ops.launch`` (its device guard and grid limits), backends
named for branching only inside ``flash_recipe.dispatch`` (all four read from the source),
kernel flags that are only valid together guarded in the kernel, and kernel flags named in one style.

Each checker is also run on a small snippet that breaks its rule, so a checker that stopped
seeing anything would fail here rather than pass in silence.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest
import torch

import flash_recipe
from flash_recipe import dispatch

PACKAGE = Path(flash_recipe.__file__).parent


def _modules() -> dict[str, ast.Module]:
    """Every module of flash_recipe by dotted name, parsed."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = ast.parse(path.read_text(), filename=str(path))
    return found


def _run_time_nodes(tree: ast.AST):
    """The nodes of ``tree`` outside ``if TYPE_CHECKING:`` blocks (those never import at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _package_of(name: str, modules: dict) -> str:
    """The package a module's relative imports start from: itself for a package, else its parent."""
    return name if any(other.startswith(name + ".") for other in modules) else name.rpartition(".")[0]


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from <module> import ...``; a relative one starts from ``package``,
    one level up per extra dot."""
    base = node.module or ""
    if not node.level:
        return base
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the flash_recipe modules it imports, at module level or inside a function."""
    graph = {name: set() for name in modules}
    for name, tree in modules.items():
        package = _package_of(name, modules)
        for node in _run_time_nodes(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from_module(node, package)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``, each as a path that returns to its start."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_flash_recipe_has_no_import_cycle():
    modules = _modules()
    assert "flash_recipe.dispatch.triton_backend" in modules and "flash_recipe.api" in modules
    graph = import_graph(modules)
    assert "flash_recipe.validate" in graph["flash_recipe.decoding"]  # the graph sees imports
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import():
    """The circle this package once had: kvcache imported api, api imported kvcache in a function."""
    modules = {
        "pkg": ast.parse(""),
        "pkg.api": ast.parse("def f():\n    from pkg.kvcache import paged\n"),
        "pkg.kvcache": ast.parse("from pkg import api\n"),
    }
    assert cycles(import_graph(modules)) == [["pkg.api", "pkg.kvcache", "pkg.api"]]


def _imports_the_package(node: ast.AST) -> bool:
    """``import flash_recipe...``, ``from flash_recipe... import ...`` or a relative import."""
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "flash_recipe"
    return isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "flash_recipe" for alias in node.names)


def function_level_imports(source: str, every_module: bool = False) -> dict[int, bool]:
    """The imports of flash_recipe modules (``every_module``: of any module) inside a function, by
    line, each with whether it says why it is not at the top of the file: a comment on its first
    line, or a line holding only a comment right above it."""
    lines = source.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    commented = {token.start[0] for token in tokens if token.type == tokenize.COMMENT}
    found = {}
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if _imports_the_package(node) or (every_module and isinstance(node, (ast.Import, ast.ImportFrom))):
                above = lines[node.lineno - 2].lstrip() if node.lineno > 1 else ""
                found[node.lineno] = node.lineno in commented or above.startswith("#")
    return found


def test_every_function_level_import_of_the_package_says_why():
    """An import of a flash_recipe module sits at the top of its file, where the import graph can be
    read; one that stays inside a function says why on its line or the line above: a cycle, Triton
    or torch kept out of an import that must not load them, a name looked up per call."""
    seen, silent = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        imports = function_level_imports(path.read_text())
        seen += len(imports)
        silent += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line, why in sorted(imports.items()) if not why]
    assert seen > 0  # the walk sees the function-level imports (the Triton backend's, for one)
    assert silent == []


def test_every_function_level_import_of_the_tools_says_why():
    """In the tools (``flash_recipe/tools``, ``devtools``) every import sits at the top, torch's and
    the standard library's too, unless it says why not: Triton on use where a command must say why it
    cannot run, an optional dependency, an environment variable read first."""
    seen, silent = 0, []
    for path in sorted([*(PACKAGE / "tools").rglob("*.py"), *(PACKAGE.parent / "devtools").rglob("*.py")]):
        imports = function_level_imports(path.read_text(), every_module=True)
        seen += len(imports)
        silent += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line, why in sorted(imports.items()) if not why]
    assert seen > 0  # the walk sees them (bench's matplotlib, for one)
    assert silent == []


def test_the_import_reason_check_finds_a_function_level_import_without_a_comment():
    snippet = textwrap.dedent("""
        import flash_recipe


        def silent():
            from flash_recipe import api
            import flash_recipe.ops
            from . import sibling
            import torch
            x = 1  # a comment on the line above is not one above the import
            from flash_recipe.ops import tuned
            # a comment with a blank line between says nothing about the import

            from ..api import explain
            return api, sibling, torch, x, tuned, explain


        def explained():
            from flash_recipe import api  # imports torch: the doctor starts without it
            # a cycle: flash_recipe.api imports this module
            from flash_recipe.ops import (
                tuned,
            )
            return api, tuned
    """)
    assert function_level_imports(snippet) == {6: False, 7: False, 8: False, 11: False, 14: False, 19: True, 21: True}
    assert function_level_imports(snippet, every_module=True)[9] is False  # torch, silent


def _launches(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """Kernel launches: ``kernel[grid](...)``, and ``plan(kernel, grid, dict(...))`` (a launch
    planned once per signature, ``flash_recipe.ops.launch``), each with the call holding its arguments."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            found.append((ast.unparse(node.func), node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("plan", "launch_once"):
            arguments = node.args[2] if len(node.args) > 2 else None
            name = f"plan({ast.unparse(node.args[0]) if node.args else ''})"
            if isinstance(arguments, ast.Call) and ast.unparse(arguments.func) == "dict":
                found.append((name, arguments))
            else:  # arguments not spelled out as dict(...) keywords at the launch
                found.append((name, ast.Call(func=node.func, args=[node], keywords=[])))
    return found


def positional_launches(tree: ast.AST) -> list[str]:
    """Kernel launches that pass an argument by position."""
    return [name for name, call in _launches(tree) if call.args]


def test_every_kernel_is_launched_by_keyword():
    launches = 0
    for path in sorted((PACKAGE / "ops").glob("*.py")):
        tree = ast.parse(path.read_text())
        launches += len(_launches(tree))
        assert positional_launches(tree) == [], path.name
    assert launches >= 9  # forward, split-combine, three backward, rotary-append, dropout mask, quantize, 8-bit


def direct_launches(tree: ast.AST) -> list[int]:
    """Lines of kernel launches that bypass ``flash_recipe.ops.launch`` (its device guard and grid
    limits): ``kernel[grid](...)``, any call of a subscript except of a module-level table (a name
    assigned a dict, list or tuple display), and ``<kernel>.run(..., grid=...)`` unless it passes
    ``warmup=True`` (a compile, which launches nothing)."""
    tables = set()
    for node in getattr(tree, "body", []):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Dict, ast.List, ast.Tuple)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            tables.update(t.id for t in targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        table = isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name) and func.value.id in tables
        subscript = isinstance(func, ast.Subscript) and not table
        run = isinstance(func, ast.Attribute) and func.attr == "run" and _launches_grid(node)
        if subscript or run:
            found.append(node.lineno)
    return found


def _launches_grid(call: ast.Call) -> bool:
    """A ``.run(grid=...)`` call that launches: not a ``warmup=True`` compile."""
    keywords = {kw.arg: kw.value for kw in call.keywords}
    warmup = keywords.get("warmup")
    return "grid" in keywords and not (isinstance(warmup, ast.Constant) and warmup.value is True)


def test_every_kernel_launch_goes_through_the_launch_module():
    """Launches are made by ``ops/launch.py`` and by the direct launch it hands each plan's launches
    to (``ops/direct.py``, which only ``launch.py`` uses)."""
    launch_modules = (PACKAGE / "ops" / "launch.py", PACKAGE / "ops" / "direct.py")
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in launch_modules
        for line in direct_launches(ast.parse(path.read_text()))
    ]
    users = [
        path.relative_to(PACKAGE.parent)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in launch_modules and re.search(r"\bdirect\.DirectLaunch\b|import DirectLaunch", path.read_text())
    ]
    assert users == [], f"the direct launch is launch.py's own: {users}"
    assert found == [], f"kernel launches outside flash_recipe/ops/launch.py (use launch.plan/launch): {found}"


def test_the_direct_launch_check_finds_every_form():
    snippet = textwrap.dedent("""
        TABLE = {"a": f}
        RUNS: dict = {"b": g}
        quantize_kernel[grid](X=x)
        kernels["fwd"][(1, 1, 1)](X=x)
        TABLE["a"](1)
        RUNS["b"]()
        fn.run(grid=grid, warmup=False, X=x)
        fn.run(grid=(1, 1, 1), warmup=True, X=x)
        (quantize_kernel
            [grid])(X=x)
        subprocess.run(cmd, check=True)
    """)
    assert direct_launches(ast.parse(snippet)) == [4, 5, 8, 10]


def test_the_launch_check_finds_a_positional_argument():
    snippet = "kernel[grid](q, K=k, BLOCK_M=64)\nother[grid](Q=q)\nplan(k, g, dict(Q=q))\nplan(k, g, dict(q, K=k))\n"
    assert positional_launches(ast.parse(snippet)) == ["kernel[grid]", "plan(k)"]


def backend_branches(tree: ast.AST, names) -> list[str]:
    """Comparisons against a backend's name (``backend.name == "triton"``, ``name in ("sdpa", ...)``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            constants = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            if constants:
                found.append(ast.unparse(node))
    return found


def test_only_dispatch_branches_on_a_backend_name():
    names = set(dispatch.backend_names())
    assert names == {"flash_attn", "triton", "sdpa", "reference"}
    for module, tree in _modules().items():
        if module == "flash_recipe.dispatch" or module.startswith("flash_recipe.dispatch."):
            continue
        assert backend_branches(tree, names) == [], module


def test_the_branch_check_finds_a_backend_name_comparison():
    snippet = textwrap.dedent("""
        if backend.name == "flash_attn":
            pass
        run = fast if backend.name != "triton" else slow
        ok = name in ("sdpa", "other")
        fine = backend.name == "unrelated"
    """)
    found = backend_branches(ast.parse(snippet), {"flash_attn", "triton", "sdpa", "reference"})
    assert sorted(found) == ["backend.name != 'triton'", "backend.name == 'flash_attn'", "name in ('sdpa', 'other')"]


def test_a_paged_launch_without_key_ranges_is_refused_by_the_kernel(monkeypatch):
    """``PAGED`` addresses keys through per-batch ranges: the kernel's ``tl.static_assert`` refuses
    a launch that passes a page table without key ranges (``K_START``/``K_END`` None, so no
    ``KV_RANGES``), instead of reading rows from a page table it has no range for. The launcher
    never does that; the launch is altered here to show it."""
    from flash_recipe.memo_keys import Memo
    from flash_recipe.ops import forward
    from flash_recipe.ops.options import KeyRanges, ScoreOptions

    planned = forward.plan

    def without_key_ranges(kernel, grid, args, device):
        if kernel is forward.attn_fwd_kernel:
            args = {**args, "K_START": None, "K_END": None}
        return planned(kernel, grid, args, device)

    monkeypatch.setattr(forward, "plan", without_key_ranges)
    monkeypatch.setattr(forward, "_PLANS", Memo())  # no plan of this signature from an earlier test
    q, pages = torch.randn(1, 4, 2, 16), torch.randn(2, 16, 2, 16)
    lengths = torch.tensor([5], dtype=torch.int32)
    keys = KeyRanges(torch.zeros_like(lengths), lengths, 32, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(Exception, match="PAGED addresses key ranges through the page table: it needs KV_RANGES"):
        options = ScoreOptions(
            softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
        )
        forward.attention_forward(q, pages, pages, options, keys=keys)


def _layer(module: str) -> str:
    """The layer a module belongs to: its first package below ``flash_recipe`` (or the module)."""
    return ".".join(module.split(".")[:2])


def private_crossings(modules: dict[str, ast.Module]) -> list[str]:
    """``importer -> module._name``: private names (one leading underscore) a module takes from
    another layer, by ``from x import _name`` or as ``x._name`` of an imported module."""
    found = []

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for name, tree in modules.items():
        imported = {}  # local name -> module, for modules bound by an import
        package = _package_of(name, modules)
        for node in _run_time_nodes(tree):
            source = _from_module(node, package) if isinstance(node, ast.ImportFrom) else ""
            if source.startswith("flash_recipe"):
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in modules:
                        imported[alias.asname or alias.name] = target
                    elif private(alias.name) and _layer(source) != _layer(name):
                        found.append(f"{name} -> {source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("flash_recipe") and alias.asname:
                        imported[alias.asname] = alias.name
        for node in _run_time_nodes(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and private(node.attr):
                target = imported.get(node.value.id)
                if target is not None and _layer(target) != _layer(name):
                    found.append(f"{name} -> {target}.{node.attr}")
    return sorted(found)


def test_no_private_name_crosses_a_layer():
    assert private_crossings(_modules()) == []


def test_the_private_name_check_finds_both_forms():
    modules = {
        "flash_recipe.api": ast.parse("def _build(): pass\n"),
        "flash_recipe.env.wheels": ast.parse("def _release(): pass\n"),
        "flash_recipe.env.doctor": ast.parse("from . import wheels\nwheels._release()\n"),
        "flash_recipe.stand_in": ast.parse(
            "from flash_recipe.api import _build, __doc__\nfrom flash_recipe.env import wheels\nwheels._release()\n"
        ),
        "flash_recipe.env.probe": ast.parse("from ..api import _build\n"),
    }
    assert private_crossings(modules) == [
        "flash_recipe.env.probe -> flash_recipe.api._build",
        "flash_recipe.stand_in -> flash_recipe.api._build",
        "flash_recipe.stand_in -> flash_recipe.env.wheels._release",
    ]


def absolute_imports(modules: dict[str, ast.Module]) -> list[str]:
    """``module:line`` of each import of the package by its own name (``import flash_recipe...``,
    ``from flash_recipe... import``, ``import_module("flash_recipe...")``). The Hub copy is imported
    under another name (docs/hub-kernel.md), so every import inside the package is relative."""
    found = []
    for name, tree in modules.items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
                first = node.args[0]
                names = [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else []
            if any(n == "flash_recipe" or n.startswith("flash_recipe.") for n in names):
                found.append(f"{name}:{node.lineno}")
    return sorted(found)


def test_every_import_inside_the_package_is_relative():
    assert absolute_imports(_modules()) == []


def test_the_absolute_import_check_finds_every_form():
    modules = {
        "flash_recipe.a": ast.parse("import flash_recipe\nfrom . import b\n"),
        "flash_recipe.b": ast.parse("def f():\n    from flash_recipe.ops import tiles\n"),
        "flash_recipe.c": ast.parse("import importlib\nimportlib.import_module('flash_recipe.api')\n"),
        "flash_recipe.d": ast.parse("import flash_recipe_extra\nfrom .ops import tiles\n"),
    }
    assert absolute_imports(modules) == ["flash_recipe.a:1", "flash_recipe.b:2", "flash_recipe.c:2"]


def script_entries(source: str) -> list[int]:
    """The lines of ``if __name__ == "__main__":`` blocks in ``source``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
    ]


def test_the_kernels_package_holds_no_script():
    """``flash_recipe.ops`` holds kernels, their launchers and what a launch needs: a command of its
    own lives in ``flash_recipe.tools``, or in the checkout's ``devtools/`` where only developers
    run it (the import-linter contracts keep ``ops`` from importing either)."""
    found = {path.name: script_entries(path.read_text()) for path in sorted((PACKAGE / "ops").glob("*.py"))}
    assert not {name: lines for name, lines in found.items() if lines}


def test_the_script_check_finds_a_main_block():
    assert script_entries('def f():\n    pass\n\n\nif __name__ == "__main__":\n    f()\n') == [5]
    assert script_entries("def f():\n    return __name__\n") == []


# What only developers run, kept in the checkout's devtools/ and out of the wheel: a module or
# package of one of these names, or any ``*_report`` module.
DEVELOPER_TOOLS = (
    "campaign", "compile_check", "compiled_code", "gpu_check", "gpu_check_cases", "capture_check",
    "backward_paths", "schedule_report", "splits_report",
)  # fmt: skip


def developer_tools_in(package: Path) -> list[str]:
    """The modules and packages under ``package`` that are developer tools (``DEVELOPER_TOOLS``)."""
    found = []
    for path in sorted(package.rglob("*")):
        name = path.stem if path.suffix == ".py" else path.name if path.is_dir() else None
        if name and (name in DEVELOPER_TOOLS or name.endswith("_report")):
            found.append(path.relative_to(package).as_posix())
    return found


def test_the_package_holds_no_developer_tool_and_devtools_holds_them_all():
    """The installed package (under ``nox -s tests``, the wheel's files) holds no campaign, compile
    check, GPU check or report; the checkout's ``devtools/`` holds each of them."""
    assert developer_tools_in(PACKAGE) == []
    devtools = Path(__file__).resolve().parents[1] / "devtools"
    missing = [n for n in DEVELOPER_TOOLS if not ((devtools / f"{n}.py").is_file() or (devtools / n).is_dir())]
    assert not missing, missing


def test_the_developer_tool_check_finds_a_module_a_package_and_a_report(tmp_path):
    for relative in ("tools/campaign/plan.py", "tools/gpu_check.py", "ops/speed_report.py", "ops/forward.py"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("")
    assert developer_tools_in(tmp_path) == ["ops/speed_report.py", "tools/campaign", "tools/gpu_check.py"]


# How a kernel's compile-time flags are named: the feature or step the variant has, in bare words
# (``CAUSAL``, ``VARLEN``, ``ALIBI``, ``SINK_LOGITS``, ``FIX_LSE``), ``MASK_*`` for a bounds mask the
# variant applies, ``EVEN_*`` for a divisibility the launch knows. No ``IS_``, ``HAS_`` or ``USE_``.
FLAG_PREFIXES_REFUSED = ("IS_", "HAS_", "USE_")


def constexpr_flags(tree: ast.AST) -> set[str]:
    """The names of the ``tl.constexpr`` parameters of every function in ``tree``."""
    return {
        arg.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for arg in node.args.args + node.args.kwonlyargs
        if arg.annotation is not None and ast.unparse(arg.annotation) in ("tl.constexpr", "triton.language.constexpr")
    }


def flags_out_of_style(tree: ast.AST) -> list[str]:
    """The constexpr flags of ``tree`` whose names take a refused prefix (``FLAG_PREFIXES_REFUSED``)."""
    return sorted(name for name in constexpr_flags(tree) if name.startswith(FLAG_PREFIXES_REFUSED))


def test_every_kernel_flag_is_named_in_one_style():
    found = {}
    flags = set()
    for path in sorted((PACKAGE / "ops").glob("*.py")):
        tree = ast.parse(path.read_text())
        flags |= constexpr_flags(tree)
        if flags_out_of_style(tree):
            found[path.name] = flags_out_of_style(tree)
    assert {"CAUSAL", "VARLEN", "SINK_LOGITS", "MASK_D", "EVEN_M", "BLOCK_M"} <= flags  # the checker sees them
    assert found == {}


def test_the_flag_style_check_finds_each_refused_prefix():
    snippet = textwrap.dedent("""
        @triton.jit
        def kernel(X, n, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr):
            pass

        def helper(USE_TMA: triton.language.constexpr, IS_OK):
            pass
    """)
    assert flags_out_of_style(ast.parse(snippet)) == ["HAS_BIAS", "IS_CAUSAL", "USE_TMA"]
