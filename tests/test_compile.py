"""The offline compile check compiles what a launch compiles, and it can fail.

``devtools.compile_check`` runs the real launchers with CPU tensors and lets Triton's own
launch path specialise and compile each kernel for a named GPU target; the GPU driver is the one
thing replaced (by an offline stand-in that launches nothing), because this machine has none.
Triton picks the interpreter or the compiler when it is imported, so every compile here runs in a
fresh process without ``TRITON_INTERPRET``. The full sweep is ``nox -s compile_check``.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
from offline import compile_in_subprocess

from devtools import backward_paths, compile_check, compiled_code
from flash_recipe.ops import choose, configs, features, targets
from flash_recipe.tools import compile_calls

ROOT = Path(__file__).resolve().parents[1]


def test_every_target_has_a_limit_and_a_family():
    assert set(compile_check.TARGETS) == set(configs.FAMILIES) == set(configs.SHARED_MEMORY_LIMIT)
    assert set(configs.FAMILY_SHARED_MEMORY) == {"sm80", "sm86", "sm90", "sm100", "sm120", "amd"}


@pytest.mark.parametrize("family", sorted(configs.FAMILY_SHARED_MEMORY) + ["interpreter"])
@pytest.mark.parametrize("kernel", configs.KERNELS)
def test_every_family_has_a_config_for_every_head_dim_and_dtype(family, kernel):
    target = next((t for t, f in configs.FAMILIES.items() if f == family), family)
    for head_dim in (1, 16, 59, 64, 96, 128, 160, 256):
        for element_size in (2, 4):
            cfg = configs.get_config(target, kernel, head_dim, element_size)
            assert cfg.block_m >= 16 and cfg.block_n >= 16  # every tl.dot dimension >= 16


def test_unknown_architectures_get_the_conservative_family_and_old_ones_are_refused():
    assert configs.arch_family("sm121") == "sm120"
    assert configs.arch_family("sm89") == "sm86"
    for unknown in ("sm87", "sm103", "sm110", "sm130"):
        assert configs.arch_family(unknown) == configs.FALLBACK_FAMILY["cuda"]
    assert configs.arch_family("gfx940") == configs.FALLBACK_FAMILY["hip"]
    with pytest.raises(ValueError, match="AMD CDNA"):
        configs.arch_family("gfx1100")
    assert configs.FAMILY_SHARED_MEMORY[configs.FALLBACK_FAMILY["cuda"]] == min(
        configs.SHARED_MEMORY_LIMIT[t] for t, f in configs.FAMILIES.items() if t.startswith("sm")
    )
    with pytest.raises(ValueError, match="must be sm80 or newer"):
        configs.arch_family("sm75")
    assert configs.shared_memory_problem("sm130", 101376) is None
    assert "sized for 101376" in configs.shared_memory_problem("sm130", 65536)
    assert "sized for 232448" in configs.shared_memory_problem("sm90", 101376)


# -- the table is data ----------------------------------------------------------------------------
MUTATING_METHODS = {"append", "extend", "update", "insert", "setdefault", "pop", "popitem", "clear", "remove"}


def _module_level(tree: ast.Module):
    """The nodes that run when the module is imported (not inside a function body)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def table_mutations(source: str) -> list[str]:
    """What in ``source`` changes a value after it was built: an assignment (plain, augmented or
    annotated) or ``del`` whose target is an item or attribute, anywhere; at module level, a
    ``for`` or ``while`` loop and a call of a mutating method (``.append``, ``.update``, ...)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            if any(isinstance(part, (ast.Subscript, ast.Attribute)) for part in ast.walk(target)):
                found.append(f"line {node.lineno}: changes {ast.unparse(target)}")
    for node in _module_level(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            found.append(f"line {node.lineno}: a loop at module level")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING_METHODS:
            found.append(f"line {node.lineno}: calls .{node.func.attr} at module level")
    return sorted(found)


def test_the_table_is_one_literal_that_nothing_changes():
    """The rows are one literal per family (``_FAMILY_ROWS``, whose shared blocks are named once and
    bound once), the lookup's ``_TABLE`` a view of it, and no statement changes either."""
    source = Path(configs.__file__).read_text()
    assert table_mutations(source) == []
    tree = ast.parse(source)
    bound = [node for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))]
    names = [ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target) for node in bound]
    assert len(names) == len(set(names))  # each name bound once
    assert isinstance(bound[names.index("_FAMILY_ROWS")].value, ast.Dict)
    view = bound[names.index("_TABLE")].value
    assert isinstance(view, ast.DictComp) and ast.unparse(view.generators[0].iter) == "_FAMILY_ROWS.items()"
    every = {(family, kernel) for family in configs.ARCHS for kernel in configs.KERNELS}
    candidates = {(family, configs.ONE_LAUNCH) for family in configs.ONE_LAUNCH_FAMILIES}
    assert set(configs._TABLE) == every | candidates  # every kernel in every family; the one launch where offered


def test_the_mutation_check_finds_each_kind():
    source = textwrap.dedent("""
        _TABLE = {("x", "y"): [(16, 2, 1)]}
        _TABLE[("x", "y")][1] = (32, 2, 2)
        _TABLE[("x", "z")] += [(16, 4, 3)]
        for kernel in ("a", "b"):
            pass
        _TABLE.update({})
        _TABLE[("x", "y")].append((64, 2, 4))

        def lookup(key):
            rows = []
            rows.append(key)  # a local list, built inside a function: not the table
            return rows
    """)
    assert table_mutations(source) == [
        "line 3: changes _TABLE['x', 'y'][1]",
        "line 4: changes _TABLE['x', 'z']",
        "line 5: a loop at module level",
        "line 7: calls .update at module level",
        "line 8: calls .append at module level",
    ]
    assert table_mutations('_TABLE = {("x", "y"): [(16, 2, 1)]}\n') == []


# Blocks of the table noted "as X": each repeats X's rows, except at the (max bucket, max element
# size) rows given, which the table says why.
SAME_ROWS = [
    *[(("sm120", kernel), ("sm86", kernel), set()) for kernel in configs.KERNELS],
    *[(("sm100", kernel), ("sm90", kernel), set()) for kernel in ("fwd", "fwd_general", "bwd_dq", "decode")],
    (("sm100", "bwd_dkdv"), ("sm90", "bwd_dkdv"), {(128, 2), (256, 2)}),
    (("sm100", "bwd_onepass"), ("sm90", "bwd_onepass"), {(256, 2)}),
    (("sm100", "bwd_onepass"), ("sm100", "bwd_dkdv"), {(128, 2)}),
    (("sm90", "decode"), ("sm80", "decode"), set()),
    *[((family, "fwd_general"), (family, "fwd"), set()) for family in ("sm80", "amd", "interpreter")],
    (("sm86", "fwd_general"), ("sm86", "fwd"), {(128, 2)}),
    (("sm90", "fwd_general"), ("sm90", "fwd"), {(64, 2), (128, 2)}),
    *[((family, "bwd_onepass"), (family, "bwd_dkdv"), set()) for family in ("amd", "interpreter")],
    (("sm80", "bwd_onepass"), ("sm80", "bwd_dkdv"), {(64, 2)}),
    (("sm86", "bwd_onepass"), ("sm86", "bwd_dkdv"), {(128, 2)}),
    (("sm90", "bwd_onepass"), ("sm90", "bwd_dkdv"), {(128, 2)}),
]


@pytest.mark.parametrize(
    ("block", "model", "differing"), SAME_ROWS, ids=lambda v: "-".join(v) if isinstance(v, tuple) else None
)
def test_a_block_noted_as_another_repeats_its_rows(block, model, differing):
    rows, model_rows = configs._TABLE[block], configs._TABLE[model]
    assert [row[:2] for row in rows] == [row[:2] for row in model_rows]
    assert {row[:2] for row, other in zip(rows, model_rows) if row[2] != other[2]} == differing


def test_overriding_replaces_one_launch_configuration_in_its_block():
    import torch

    cpu = torch.device("cpu")
    table = choose.launch_config(cpu, "fwd", 100, 2)
    assert table == configs.get_config("interpreter", "fwd", 100, 2)
    candidate = configs.Config(16, 16, 1, 1)
    with choose.overriding("fwd", 128, 2, candidate):
        assert choose.launch_config(cpu, "fwd", 100, 2) == candidate  # same bucket, same element size
        assert choose.launch_config(cpu, "fwd", 100, 4) == configs.get_config("interpreter", "fwd", 100, 4)
        assert choose.launch_config(cpu, "bwd_dq", 128, 2) == configs.get_config("interpreter", "bwd_dq", 128, 2)
    assert choose.launch_config(cpu, "fwd", 100, 2) == table
    with pytest.raises(ValueError, match="kernel must be one of"), choose.overriding("forward", 128, 2, candidate):
        pass


def test_main_loop_is_the_shortest_conditional_back_edge_over_matrix_instructions():
    lines = [
        (0x000, "MOV R1, c[0x0][0x28]"),
        (0x010, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ"),  # before any loop: not counted
        (0x020, "FMNMX R2, R3, R4, !PT"),  # masked loop: 0x020..0x070
        (0x030, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24"),
        (0x040, "NOP"),
        (0x050, "FSEL R5, R6, -INF, P1"),
        (0x060, "ISETP.GT.AND P0, PT, R7, UR5, PT"),
        (0x070, "@!P0 BRA 0x20"),
        (0x080, "FFMA R2, R3, R4, -R5"),  # unmasked loop: 0x080..0x0b0, 4 instructions
        (0x090, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24"),
        (0x0A0, "MUFU.EX2 R2, R2"),
        (0x0B0, "@P1 BRA 0x80"),
        (0x0B8, "@P2 EXIT"),  # an early exit is not the end
        (0x0C0, "EXIT"),
        (0x0D0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13], R2"),  # out of line: a spin loop, then back
        (0x0E0, "@!P0 BRA 0xd0"),
        (0x0F0, "BRA 0x90"),
        (0x100, "BRA 0x100"),
    ]
    sass = "\n".join(f"        /*{address:04x}*/    {text} ;    /* 0x0000 */" for address, text in lines)
    assert compiled_code.main_loop(sass) == 4
    assert compiled_code.main_loop(sass.replace("@P1 BRA 0x80", "NOP")) == 5  # the masked loop, NOP excluded
    assert compiled_code.main_loop("/*0000*/ MOV R1, R2 ;\n/*0010*/ @P0 BRA 0x0 ;") is None  # no matrix loop
    rotated = [  # a loop that tests its exit at the top and jumps back unconditionally (sm80)
        (0x000, "ISETP.GE.AND P0, PT, R1, R2, PT"),
        (0x010, "@P0 BRA 0x60"),
        (0x020, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x030, "FFMA R2, R3, R4, -R5"),
        (0x040, "IADD3 R1, R1, 0x40, RZ"),
        (0x050, "BRA 0x0"),
        (0x060, "EXIT"),
        (0x070, "BRA 0x70"),
    ]
    sass = "\n".join(f"        /*{address:04x}*/    {text} ;" for address, text in rotated)
    assert compiled_code.main_loop(sass) == 6
    uniform = sass.replace("@P0 BRA 0x60", "BRA.U UP0, 0x60").replace("BRA 0x0", "BRA.U !UP1, 0x0")  # sm120
    assert compiled_code.main_loop(uniform) == 6


def test_amd_main_loop_is_the_shortest_back_branch_over_mfma():
    """AMD's assembly, the same rule as SASS: a branch back to an earlier label before the last
    ``s_endpgm``, over ``v_mfma`` instructions; labels, directives, comments and ``s_nop`` padding
    are not counted."""
    asm = "\n".join(
        [
            "attn_kernel:",
            "\ts_load_dwordx2 s[0:1], s[4:5], 0x0",
            "\tv_mfma_f32_32x32x8_bf16 v[0:15], v[16:17], v[18:19], 0",  # before any loop: not counted
            ".LBB0_1:                                ; =>This Inner Loop Header: Depth=1",  # masked loop
            "\t.loc\t1 153 34                        ; backward.py:153:34",
            "\tv_max_f32_e32 v1, v2, v3",
            "\tv_mfma_f32_32x32x8_bf16 v[0:15], v[16:17], v[18:19], v[0:15]",
            "\tv_cmp_gt_i32_e32 vcc, s2, v7",
            "\tv_cndmask_b32_e32 v4, v5, v6, vcc",
            "\ts_cbranch_scc1 .LBB0_1",
            ".LBB0_2:                                ; =>This Inner Loop Header: Depth=1",  # unmasked: 4
            "\tv_fma_f32 v1, v2, v3, v4",
            ".Ltmp7:",
            "\tv_mfma_f32_32x32x8_bf16 v[0:15], v[16:17], v[18:19], v[0:15]",
            "\ts_nop 7",
            "\tv_exp_f32_e32 v1, v1",
            "\ts_cbranch_scc0 .LBB0_2",
            "; %bb.3:",
            "\ts_endpgm",
            ".LBB0_4:",  # after the end: a retry returning into the code
            "\tv_mfma_f32_32x32x8_bf16 v[0:15], v[16:17], v[18:19], v[0:15]",
            "\ts_branch .LBB0_4",
        ]
    )
    assert len(compiled_code.amd_main_loop_body(asm)) == 4
    unrolled = asm.replace("s_cbranch_scc0 .LBB0_2", "s_nop 0")
    assert len(compiled_code.amd_main_loop_body(unrolled)) == 5  # the masked loop
    assert compiled_code.amd_main_loop_body(asm.replace("v_mfma", "v_add")) is None  # no matrix loop
    assert compiled_code.amd_main_loop_body("\ts_branch .LBB0_9\n.LBB0_9:\n\ts_endpgm") is None  # forward


def test_matrix_work_of_the_main_loop_counts_each_instruction_shape():
    """HMMA m16n8k16 runs once per warp, HGMMA 64xNx16 once per warpgroup of 4; an instruction whose
    shape the mnemonic does not give (sm100's UTC*MMA) leaves the count unknown."""
    lines = [
        (0x000, "MOV R1, c[0x0][0x28]"),
        (0x010, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x020, "HMMA.1688.F32.TF32 R4, R8, R12, R4"),
        (0x030, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24"),
        (0x040, "@P0 BRA 0x10"),
        (0x050, "EXIT"),
    ]
    sass = "\n".join(f"        /*{address:04x}*/    {text} ;" for address, text in lines)
    assert compiled_code.loop_matrix_macs(sass, num_warps=8) == 8 * 16 * 8 * 16 + 8 * 16 * 8 * 8 + 2 * 64 * 64 * 16
    assert compiled_code.loop_matrix_macs(sass.replace("HGMMA.64x64x16", "UTCHMMA"), num_warps=8) is None
    assert compiled_code.loop_matrix_macs("/*0000*/ MOV R1, R2 ;", num_warps=4) is None


def test_each_dot_is_counted_on_the_unit_its_layout_names():
    """A TTGIR's dots by unit: Hopper's warp_group_dot, Blackwell's tc_gen5_mma, a tt.dot with an
    nvidia_mma layout of version 2 (mma.sync) or 3, with a #blocked one (FMA) or an AMD one; in
    Triton 3.9's dialect names and 3.2's; the waits and loads beside them are not dots."""
    ttgir = """
#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [8, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 128, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], instrShape = [16, 8]}>
#mma2 = #triton_gpu.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 8]}>
#mma3 = #ttg.amd_mfma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [32, 32]}>
    %a = ttng.warp_group_dot %x, %y, %c {isAsync = true} : !ttg.memdesc<128x128xbf16> -> tensor<128x32xf32, #mma>
    %b:3 = ttng.warp_group_dot_wait %a, %x, %y {pendings = 0 : i32} : tensor<128x32xf32, #mma> loc(#loc1)
    ttng.tc_gen5_mma %x, %y, %t, %false, %true, %bar[%true] {is_async} : !ttg.memdesc<128x128xbf16> loc(#loc2)
    %d = tt.dot %p, %q, %c : tensor<32x128xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma1}>> -> tensor<32x128xf32, #mma1>
    %e = tt.dot %p, %q, %c : tensor<16x16xbf16, #triton_gpu.dot_op<{opIdx = 0}>> -> tensor<16x16xf32, #mma2> loc(#loc4)
    %f = tt.dot %p, %q, %c, inputPrecision = ieee : tensor<32x32xf32> -> tensor<32x32xf32, #blocked> loc(#loc5)
    %g = tt.dot %p, %q, %c : tensor<32x32xf16> * tensor<32x32xf16> -> tensor<32x32xf32, #mma3> loc(#loc6)
    %h = ttg.local_load %k : !ttg.memdesc<128x128xbf16> -> tensor<128x128xbf16, #ttg.dot_op<{parent = #mma1}>>
"""
    assert compiled_code.dot_units(ttgir) == {"wgmma": 1, "tcgen05": 1, "mma.sync": 2, "fma": 1, "mfma": 1}
    assert compiled_code.dot_units("") == {}


@pytest.mark.slow
def test_backward_products_per_block_pair_are_five_in_one_pass_and_seven_in_two():
    """The one-pass backward's main loop issues 5 block-pair products (S, dP, dV, dK and dQ); the
    deterministic path's dQ kernel 3 and dK/dV kernel 4, as before; on sm80 (HMMA) and sm90 (HGMMA),
    with MHA and with GQA (its own specialisation, a row of its own), none spilling. On sm90 and
    sm100 every dot is on the fast unit (wgmma, tcgen05): dQ is computed transposed, its M the head
    dim. Planted: a one-pass kernel issuing the dQ kernel's recomputation too (7) fails the check, and
    so does dQ as the direct product of the 32-row query tile (``configs.MMA_MIN_ROWS`` emptied),
    which those units cannot take and which compiles to mma.sync. The ``bwd`` call compiles the one
    pass where the installed Triton's release rule runs it (``configs.ONE_PASS_TRITON``): elsewhere
    ``--call one_pass`` reports that tile, and this test has nothing to read."""
    for family in ("sm90", "sm100"):
        if not choose.release_takes_one_pass(family, 128):
            pytest.skip(f"Triton {targets.triton_release()} runs the three kernels on {family} at head dim 128")
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.ops import configs
        from devtools import compile_check
        case = compile_check.Case("bwd", "bfloat16", 128, "aligned")
        for target in ("sm80", "sm90", "sm100", "gfx90a", "gfx942"):
            for row in compile_check.check_case(case, target):
                print(json.dumps(row))
        configs.MMA_MIN_ROWS.clear()  # as on a family whose matrix unit takes 16 rows: dS K direct
        for target in ("sm90", "sm100"):
            for row in compile_check.check_case(case, target):
                print(json.dumps({**row, "planted": True}))
    """)
    found = {
        (row["target"], row["kernel"], row["case"].endswith("-gqa"), row.get("planted", False)): row
        for row in rows
        if row["kernel"] != "bwd_preprocess"
    }
    expected = {"bwd_onepass": 5, "bwd_dq": 3, "bwd_dkdv": 4}
    targets_run = ("sm80", "sm90", "sm100", "gfx90a", "gfx942")  # AMD: the two that disagree at 128
    for target in targets_run:
        for grouped in (False, True):
            chosen = {kernel: found[(target, kernel, grouped, False)] for kernel in expected}
            if target in compile_check.PRODUCT_TARGETS:
                assert {kernel: row["loop_products"] for kernel, row in chosen.items()} == expected
            assert all(row["ok"] and not row["spill_bytes"] for row in chosen.values()), chosen
            if target in compile_check.FAST_MMA_TARGETS:
                assert all(compile_check.needs_fast_matrix_unit(row) for row in chosen.values())
                assert all(row["sync_dots"] == 0 and row["loop_hmma"] == 0 for row in chosen.values()), chosen
    if targets.triton_release()[:2] == (3, 9):  # the Triton the documented figures were compiled with
        documented = backward_paths.read_markdown((ROOT / "docs" / "performance.md").read_text())
        compiled = backward_paths.path_rows([row for row in rows if not row.get("planted")])
        assert compiled == [row for row in documented if row["head_dim"] == 128 and row["target"] in targets_run]
    planted = compile_check._verdict({**found[("sm90", "bwd_onepass", False, False)], "loop_products": 7.0})
    assert not planted["ok"] and "7.0 matrix products per block pair, expected 5" in planted["problems"][0]
    for target in ("sm90", "sm100"):
        for grouped in (False, True):
            slow = found[(target, "bwd_onepass", grouped, True)]
            assert slow["sync_dots"] >= 1 and slow["loop_hmma"] > 0, slow  # dS K, in each stage's loop
            assert not slow["ok"] and any("on mma.sync" in problem for problem in slow["problems"]), slow
            assert all(found[(target, kernel, grouped, True)]["ok"] for kernel in ("bwd_dq", "bwd_dkdv"))


@pytest.mark.slow
@pytest.mark.skipif(
    targets.triton_release() < compile_check.PROXY["since_triton"], reason="the bound was measured with Triton 3.9"
)
def test_the_speed_proxy_holds_for_the_table_and_fails_for_the_old_tile():
    """The aligned sm90 forward at head dim 128 costs at most the tutorial's instructions per key; its
    former tile (128x64 keys, pointer loads) cost more, and the check says so."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.ops import configs, features
        from devtools import compile_check
        case = compile_check.Case("fwd", "bfloat16", 128, "aligned")
        for row in compile_check.check_case(case, "sm90"):
            print(json.dumps(row))
        configs._TABLE[("sm90", "fwd")] = [(128, 2, configs.Config(128, 64, 8, 3))]
        with features.using_descriptors(False):
            for row in compile_check.check_case(case, "sm90"):
                print(json.dumps(row))
    """)
    table, old = rows
    assert compile_check.proxy_applies(table) and compile_check.proxy_applies(old)
    assert table["ok"] and table["loop_per_row"] <= compile_check.PROXY["per_key"], table
    assert table["loop_step"] == 128 and old["loop_step"] == 64
    assert not old["ok"] and old["loop_per_row"] > compile_check.PROXY["per_key"]
    assert any("instructions per key" in problem for problem in old["problems"]), old


@pytest.mark.slow
def test_an_oversized_config_is_rejected():
    """The check can fail: a 128x128, 3-stage forward at head dim 256 cannot fit sm120's 99 KiB."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.ops import configs
        from devtools import compile_check
        oversized = configs.Config(128, 128, 8, 3)
        configs._TABLE[("sm120", "fwd")] = [(256, 4, oversized)]
        for row in compile_check.check_case(compile_check.Case("fwd", "bfloat16", 256, "aligned"), "sm120"):
            print(json.dumps(row))
    """)
    (row,) = rows
    assert not row["ok"] and row["shared_bytes"] > row["shared_limit"] == 101376
    assert any("over the 101376 B limit" in problem for problem in row["problems"])


@pytest.mark.slow
def test_a_kernel_compiled_to_a_trap_is_rejected():
    """The check can fail on code that would trap at run time: Triton 3.9 compiles the sm100 dK/dV
    kernel with 64-key blocks at head dim 256, every option on, into a trap."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.ops import configs
        from devtools import compile_check
        configs._TABLE[("sm100", "bwd_dkdv")] = [(256, 4, configs.Config(32, 64, 4, 1))]
        for row in compile_check.check_case(compile_check.Case("bwd", "bfloat16", 256, "ragged"), "sm100"):
            print(json.dumps(row))
    """)
    (dkdv,) = [row for row in rows if row["kernel"] == "bwd_dkdv"]
    if dkdv["stores"]:
        pytest.skip("this Triton compiles that tile properly")
    assert not dkdv["ok"] and any("trap" in problem for problem in dkdv["problems"])


@pytest.mark.slow
@pytest.mark.skipif(
    not (features.descriptors_available() and features.warp_specialization_available()),
    reason="this Triton has no tensor descriptors or no warp specialisation",
)
def test_the_warp_specialised_forward_splits_its_loops_and_the_check_sees_a_whole_one():
    """Asked for, the sm100 forward's loops are split into partitions (loads, matrix products,
    softmax) with no spill at head dims 64 and 128, causal and not; the plain forward elsewhere
    (sm90). Planted: offered to sm90, whose partitioner leaves the 8-warp loop whole, the check
    fails it."""
    if any(features.warp_specialization_triton_problem("sm100", d) for d in (64, 128)):
        pytest.skip("this Triton does not compile it at head dims 64 and 128 (features.WARP_SPEC_TRITON)")
    rows = compile_in_subprocess("""
        import json
        from flash_recipe import memo_keys
        from flash_recipe.ops import features
        from devtools import compile_check
        for target in ("sm100", "sm90"):
            for head_dim in (64, 128):
                case = compile_check.Case("fwd_ws", "bfloat16", head_dim, "aligned")
                for row in compile_check.check_case(case, target):
                    print(json.dumps(row))
        features.WARP_SPEC_FAMILIES = ("sm90",)
        features.WARP_SPEC_TRITON[("sm90", 128)] = features.WARP_SPEC_TRITON[("sm100", 128)]
        memo_keys.forget()  # the launch plans made above without it
        for row in compile_check.check_case(compile_check.Case("fwd_ws", "bfloat16", 128, "aligned"), "sm90"):
            print(json.dumps({**row, "planted": True}))
    """)
    blackwell = [row for row in rows if row["target"] == "sm100"]
    assert len(blackwell) == 4 and all(row["kernel"] == "fwd_ws" for row in blackwell)  # causal and not, 2 dims
    assert all(row["ok"] and row["spill_bytes"] == 0 and row["warp_partitions"] >= 2 for row in blackwell), blackwell
    # both partitions' loops were found: the matrix products' and the softmax's (no matrix instruction)
    assert all(row["softmax_loop_instructions"] and row["loop_instructions"] for row in blackwell)
    hopper = [row for row in rows if row["target"] == "sm90" and not row.get("planted")]
    assert len(hopper) == 4 and all(row["kernel"] == "fwd" and row["warp_partitions"] == 0 for row in hopper)
    planted = [row for row in rows if row.get("planted")]
    assert planted and all(row["kernel"] == "fwd_ws" and not row["ok"] for row in planted), planted
    assert all("Triton left the loop whole" in row["problems"][-1] for row in planted)


@pytest.mark.slow
def test_launch_specialisation_is_applied():
    """Aligned pointers and strides divisible by 16 let Triton multi-buffer the loads: the sm90
    forward at head dim 128 needs far more shared memory than an unspecialised compile reports
    (49,152 bytes), and a kernel compiled for one target is never reused for another."""
    rows = compile_in_subprocess("""
        import json
        from devtools import compile_check
        for target in ("sm90", "sm120", "gfx942"):
            for row in compile_check.check_case(compile_check.Case("fwd", "bfloat16", 128, "aligned"), target):
                print(json.dumps(row))
        for row in compile_check.check_case(compile_check.Case("fwd", "float32", 64, "aligned"), "sm80"):
            print(json.dumps(row))
        from triton.runtime.driver import driver
        slots = vars(driver)  # the active driver's slot, named differently across Triton releases
        print(json.dumps({"driver_after": type(slots.get("_active", slots.get("active"))).__name__}))
    """)
    fp32 = rows.pop(-2)  # full-precision fp32 dots run on the FMA units, which the check sees and allows
    assert fp32["dtype"] == "float32" and fp32["fma_dots"] > 0 and fp32["ok"], fp32
    assert rows.pop()["driver_after"] != "OfflineDriver"  # the stand-in driver is removed afterwards
    assert all(row["fma_dots"] == 0 for row in rows), rows
    by_target = {row["target"]: row for row in rows}
    assert set(by_target) == {"sm90", "sm120", "gfx942"}
    assert by_target["sm90"]["shared_bytes"] > 49152 and by_target["sm90"]["matrix_unit"] == "wgmma"
    assert by_target["sm120"]["matrix_unit"] == "mma.sync"  # no wgmma on sm120
    assert by_target["gfx942"]["matrix_unit"] == "mfma"
    assert all(row["ok"] for row in rows), rows


@pytest.mark.slow
def test_a_decode_step_over_a_dense_cache_compiles():
    """A dense KV cache is addressed as one page per sequence, so its page table is one entry wide
    and a launch specialises that width to the constant 1; the kernel must compile with it (a
    method call on the width, ``table_width.to(...)``, compiled for every paged cache and failed
    only there, the most common decoding call)."""
    rows = compile_in_subprocess("""
        import json
        from devtools import compile_check
        for row in compile_check.check_case(compile_check.Case("decode", "bfloat16", 128, "aligned"), "sm90"):
            print(json.dumps(row))
    """)
    assert {row["kernel"] for row in rows} == {"rotary_append", "decode", "split_combine"}, rows
    assert all(row["ok"] for row in rows), rows


def test_the_presets_select_what_ci_and_compat_compile():
    """``--preset full``: 5 calls x 3 head dims, every target aligned in bf16, one target per family
    in fp32; on one target per family the small head dims (16, 32) aligned and the large ones
    ragged, in bf16: every head-dim bucket is compiled. Packed sequences and paged caches
    (``varlen``, ``paged``): every head dim aligned in bf16 on one target per family. Attention
    sinks (``sinks``): head dim 128 on every target, 64 on one per family, aligned in bf16. Folded
    grids (``folded``): head dim 128 aligned in bf16 on sm80, sm90, sm100 and gfx942. The one-launch
    backward (``one_launch``): head dims up to 128, both forms, bf16, on a target of each NVIDIA
    family (sm80, sm86, sm90, sm100, sm120; its two rows, 64 and 128, aligned in ci). ``--preset
    ci`` is part of full: the forward, backward and decode step at head dim 128 on every target, the
    other configuration rows on each family target, every call, dtype, form, head-dim bucket and
    target of full, each family target in fp32 and ragged. ``--preset compat``: 4 calls at
    head dim 128 in bf16, both forms, sm80 and sm90, and the warp-specialised forward where full
    has it. An option narrows a preset; no preset means every combination."""
    full = compile_check.select_jobs("full")
    ci = compile_check.select_jobs("ci")
    assert set(ci) < set(full) and len(set(ci)) == len(ci)
    every_target = {
        (compile_check.Case(call, "bfloat16", 128, "aligned"), t)
        for call in ("fwd", "bwd", "decode")
        for t in compile_check.TARGETS
    }
    assert every_target <= set(ci)
    rows = {(c.call, c.head_dim, t) for c, t in ci if c.dtype == "bfloat16" and c.form == "aligned"}
    families = compile_check.FAMILY_TARGETS
    assert {(call, d, t) for call in ("fwd", "bwd", "decode") for d in (64, 256) for t in families} <= rows
    for field in ("call", "dtype", "form", "head_dim"):
        assert {getattr(c, field) for c, _ in ci} == {getattr(c, field) for c, _ in full}, field
    assert {t for _, t in ci} == set(compile_check.TARGETS)
    for family in compile_check.FAMILY_TARGETS:
        mine = [c for c, t in ci if t == family]
        assert {"float32", "bfloat16"} <= {c.dtype for c in mine} and {c.form for c in mine} == {"aligned", "ragged"}
    assert {(c.call, c.head_dim, t) for c, t in ci if c.call in ("folded", "fwd_ws")} == {
        (c.call, c.head_dim, t) for c, t in full if c.call in ("folded", "fwd_ws")
    }
    rest = full
    sinks = [(c, t) for c, t in rest if c.call == "sinks"]
    assert {(c.head_dim, t) for c, t in sinks} == {(128, t) for t in compile_check.TARGETS} | {
        (64, t) for t in compile_check.FAMILY_TARGETS
    }
    assert {(c.form, c.dtype) for c, _ in sinks} == {("aligned", "bfloat16")}
    int8 = [(c, t) for c, t in rest if c.call == "int8"]
    assert {(c.head_dim, c.form, t) for c, t in int8} == {
        (d, "aligned", t) for d in (64, 128, 256) for t in compile_check.TARGETS
    } | {(d, "ragged", t) for d in (64, 128) for t in compile_check.FAMILY_TARGETS}
    warp_spec = [(c, t) for c, t in rest if c.call == "fwd_ws"]  # where it is offered (features.WARP_SPEC_FAMILIES)
    assert {(c.head_dim, c.form, c.dtype, t) for c, t in warp_spec} == {
        (d, "aligned", "bfloat16", "sm100") for d in (16, 32, 64, 128)
    }
    folded = [(c, t) for c, t in rest if c.call == "folded"]  # one target per NVIDIA generation, and AMD's
    assert {(c.head_dim, c.form, c.dtype, t) for c, t in folded} == {
        (128, "aligned", "bfloat16", t) for t in ("sm80", "sm90", "sm100", "gfx942")
    }
    one_launch = [(c, t) for c, t in rest if c.call == "one_launch"]  # where it is a candidate
    assert {(c.head_dim, c.form, c.dtype, t) for c, t in one_launch} == {
        (d, f, "bfloat16", t)
        for d in (16, 32, 64, 128)
        for f in ("aligned", "ragged")
        for t in ("sm80", "sm86", "sm90", "sm100", "sm120")
    }
    assert {(c.head_dim, c.form, t) for c, t in ci if c.call == "one_launch"} == {
        (d, "aligned", t) for d in (64, 128) for t in ("sm80", "sm86", "sm90", "sm100", "sm120")
    }
    rest = [(c, t) for c, t in rest if c.call not in ("sinks", "int8", "fwd_ws", "folded", "one_launch")]
    packed = [(c, t) for c, t in rest if c.call in ("varlen", "paged")]
    assert len(packed) == 2 * 5 * len(compile_check.FAMILY_TARGETS)
    assert {t for _, t in packed} == set(compile_check.FAMILY_TARGETS)
    assert {(c.form, c.dtype) for c, _ in packed} == {("aligned", "bfloat16")}
    rest = [(c, t) for c, t in rest if (c, t) not in packed]
    small = [(c, t) for c, t in rest if c.head_dim in (16, 32)]
    aligned = [(c, t) for c, t in rest if c.form == "aligned" and c.head_dim not in (16, 32)]
    ragged = [(c, t) for c, t in rest if c.form == "ragged"]
    families = {"sm80", "sm86", "sm90", "sm100", "sm120", "gfx942"}
    assert len(aligned) == 5 * 3 * (len(compile_check.TARGETS) + len(compile_check.FAMILY_TARGETS))
    assert {t for c, t in aligned if c.dtype == "bfloat16"} == set(compile_check.TARGETS)
    assert {t for c, t in aligned if c.dtype == "float32"} == set(compile_check.FAMILY_TARGETS)
    assert len(ragged) == 5 * 3 * 6
    assert len(small) == 5 * 2 * 6 and {(c.form, c.dtype) for c, _ in small} == {("aligned", "bfloat16")}
    assert {c.call for c, _ in rest} == {"fwd", "options", "bwd", "decode", "decode_paged"}
    assert {c.head_dim for c, _ in rest} == set(compile_check.HEAD_DIM_BUCKETS)
    assert {c.dtype for c, _ in ragged} == {"bfloat16"} and {c.head_dim for c, _ in ragged} == {64, 128, 256}
    assert {t for _, t in ragged} == families and {t for _, t in small} == families
    assert {configs.arch_family(t) for t in families} == set(configs.FAMILIES.values())
    compat = compile_check.select_jobs("compat")
    compat_ws = [(c, t) for c, t in compat if c.call == "fwd_ws"]  # where it is offered, as in ci
    assert {(c.head_dim, c.form, c.dtype, t) for c, t in compat_ws} == {
        (c.head_dim, c.form, c.dtype, t) for c, t in warp_spec
    }
    compat = [(c, t) for c, t in compat if c.call != "fwd_ws"]
    assert len(compat) == 4 * 2 * 2 and {t for _, t in compat} == {"sm80", "sm90"}
    assert {(c.dtype, c.head_dim) for c, _ in compat} == {("bfloat16", 128)}
    assert {t for _, t in compile_check.select_jobs("ci", targets=["sm90", "sm89"], forms=["ragged"])} == {"sm90"}
    everything = compile_check.select_jobs()
    assert len(everything) == len(compile_check.TARGETS) * len(list(compile_check.cases()))


@pytest.mark.slow
@pytest.mark.parametrize("target", compile_check.DECODE_TARGETS)
def test_decoding_stays_bound_by_bytes_not_instructions(target):
    """The aligned GQA decode step (bf16, head dim 128) issues at most ``DECODE_BOUND``
    warp-instructions per cached key per kv head: 32 over a dense cache (group 4), 48 over a paged
    one (group 8); and it packs the group into one program, without spilling."""
    rows = compile_in_subprocess(f"""
        import json
        from devtools import compile_check
        for call in ("decode", "decode_paged"):
            for row in compile_check.check_case(compile_check.Case(call, "bfloat16", 128, "aligned"), "{target}"):
                print(json.dumps(row))
    """)
    decode = {row["call"]: row for row in rows if row["kernel"] == "decode"}
    assert set(decode) == {"decode", "decode_paged"}
    for call, row in decode.items():
        assert row["ok"] and row["spill_bytes"] == 0, row
        assert row["per_key_per_kv_head"] <= compile_check.DECODE_BOUND[call], row


@pytest.mark.slow
def test_the_instruction_bound_fails_without_packing():
    """The bound can fail: with one program per query head (packing off) the dense decode step at
    group 4 reads each kv head's cache 4 times and issues 4 times the instructions per key."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.ops import forward
        from devtools import compile_check
        packing = forward.gqa_packing
        forward.gqa_packing = lambda *args, **kwargs: packing(*args[:7], pack_gqa=False)
        for row in compile_check.check_case(compile_check.Case("decode", "bfloat16", 128, "aligned"), "sm90"):
            print(json.dumps(row))
    """)
    (row,) = [row for row in rows if row["kernel"] == "decode"]
    assert row["per_key_per_kv_head"] > compile_check.DECODE_BOUND["decode"] and not row["ok"], row
    assert any("warp-instructions per cached key per kv head" in problem for problem in row["problems"])


def test_constexpr_arguments_are_read_in_both_of_tritons_forms():
    """Triton 3.2 keys a compiled kernel's constexprs by name, later releases by ``(index,)``; the
    decode rows' loop step and GQA packing come from them (under 3.2 they were lost, and the
    instruction bound failed on ``None``: found by ``torch_compat(2.6)``)."""
    from types import SimpleNamespace

    fn = SimpleNamespace(arg_names=["Q", "BLOCK_N", "PACK_GQA"])
    by_name = SimpleNamespace(src=SimpleNamespace(fn=fn, constants={"BLOCK_N": 64, "PACK_GQA": True}))
    by_index = SimpleNamespace(src=SimpleNamespace(fn=fn, constants={(1,): 64, (2,): True}))
    assert compile_calls.constants(by_name) == compile_calls.constants(by_index) == {"BLOCK_N": 64, "PACK_GQA": True}


def _int8_row(**changes) -> dict:
    row = dict(
        case="int8-bfloat16-d128-aligned",
        kernel="int8",
        target="sm90",
        dtype="bfloat16",
        head_dim=128,
        form="ragged",
        stores=True,
        shared_bytes=1,
        shared_limit=2,
        spill_bytes=0,
        fma_dots=0,
        sync_dots=0,
        matrix_unit="wgmma",
        loop_integer_mma=4,
        loop_fp8_mma=0,
        loop_hmma=0,
        loop_per_row=5.0,
        per_key_per_kv_head=None,
        call="int8",
    )
    return compile_check._verdict({**row, **changes})


@pytest.mark.parametrize(
    "changes,words",
    [
        (dict(loop_integer_mma=0), "integer tensor cores"),
        (dict(kernel="int8_fp8"), "FP8 tensor cores"),
        (dict(spill_bytes=8), "spills 8 B"),
        (dict(sync_dots=1, loop_hmma=2), "mma.sync"),
    ],
    ids=["no-imma", "fp8-without-qmma", "ragged-spill", "mma-sync-on-sm90"],
)
def test_int8_rules_fail_what_they_forbid(changes, words):
    """8-bit attention's rows fail without integer (or, for FP8 P.V, FP8) matrix instructions in the
    loop, with any spill in either form, or with a dot on mma.sync on sm90/sm100."""
    assert _int8_row()["ok"]
    row = _int8_row(**changes)
    assert not row["ok"] and any(words in p for p in row["problems"]), row["problems"]


@pytest.mark.slow
def test_int8_kernels_compile_on_integer_and_fp8_tensor_cores():
    """sm90 at head dim 128: the quantizer, then the kernel with fp16 P.V (IGMMA, then HGMMA) and
    FP8 P.V (IGMMA, then QGMMA), 0 spills, 2 products per block pair."""
    rows = compile_in_subprocess("""
        import json
        from devtools import compile_check
        for row in compile_check.check_case(compile_check.Case("int8", "bfloat16", 128, "aligned"), "sm90"):
            print(json.dumps(row))
    """)
    kernels = {row["kernel"]: row for row in rows}
    assert set(kernels) == {"quantize", "int8", "int8_fp8"}, [row["problems"] for row in rows]
    assert all(row["ok"] for row in rows), [row["problems"] for row in rows]
    assert kernels["int8"]["loop_integer_mma"] and not kernels["int8"]["loop_fp8_mma"]
    assert kernels["int8_fp8"]["loop_integer_mma"] and kernels["int8_fp8"]["loop_fp8_mma"]
    assert kernels["int8"]["loop_products"] == kernels["int8_fp8"]["loop_products"] == 2
