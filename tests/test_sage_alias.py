"""``install_as_sageattention()``: ``import sageattention`` gives flash_recipe's 8-bit attention
(flash_recipe.sageattention), by the mechanism that serves ``install_as_flash_attn()``
(flash_recipe.alias).

Installing a stand-in changes ``sys.modules`` and ``sys.meta_path`` for good, so each case runs in
a fresh interpreter. Upstream SageAttention needs a CUDA build; the cases that need an installed
one use a fake package (and dist-info) on a temporary ``sys.path`` entry.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import flash_recipe
from flash_recipe import alias
from flash_recipe.sage import SAGE_NAMES, sageattn

NO_UPSTREAM = pytest.mark.skipif(
    importlib.util.find_spec("sageattention") is not None, reason="SageAttention is installed here"
)


def _python(code: str, *paths) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``paths`` first on sys.path."""
    prelude = "import sys; sys.path[:0] = %r\n" % [str(p) for p in paths]
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def _json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@NO_UPSTREAM
def test_import_sageattention_gives_every_name():
    answer = _json(
        _python(
            """
            import importlib.metadata as md, importlib.util, json, warnings
            warnings.simplefilter("error")
            import flash_recipe
            from flash_recipe import alias, sage
            try:
                md.version("sageattention")
                before = "found"
            except md.PackageNotFoundError:
                before = None
            assert flash_recipe.install_as_sageattention() and flash_recipe.install_as_sageattention()
            import sageattention
            from sageattention import sageattn, sageattn_varlen
            dist = md.distribution("SageAttention")
            print(json.dumps({
                "before": before,
                "version": sageattention.__version__,
                "metadata": [md.version(n) for n in ("sageattention", "SageAttention", "SAGEATTENTION")],
                "name": dist.metadata["Name"],
                "stand_in": alias.is_stand_in(dist),
                "listed": [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] == "sageattention"],
                "same": [n for n in sage.SAGE_NAMES if getattr(sageattention, n) is getattr(sage, n)],
                "all": sorted(sageattention.__all__),
                "found": importlib.util.find_spec("sageattention") is not None,
                "flash_attn": alias.is_installed("flash_attn"),
            }))
            """
        )
    )
    assert answer == {
        "before": None,
        "version": "2.2.0",
        "metadata": ["2.2.0"] * 3,
        "name": "sageattention",
        "stand_in": True,
        "listed": ["sageattention"],
        "same": list(SAGE_NAMES),
        "all": sorted(["__version__", *SAGE_NAMES]),
        "found": True,  # diffusers and ComfyUI nodes probe this
        "flash_attn": False,  # the two stand-ins are installed one by one
    }


@NO_UPSTREAM
def test_both_stand_ins_answer_metadata_together():
    """One metadata finder answers for every installed stand-in; the doctor's distribution probe
    tells each from a real install."""
    answer = _json(
        _python(
            """
            import importlib.metadata as md, json, flash_recipe
            from flash_recipe.env.distinfo import distribution_info
            assert flash_recipe.install_as_flash_attn() and flash_recipe.install_as_sageattention()
            names = {"flash-attn", "sageattention"}
            print(json.dumps({
                "versions": [md.version("flash_attn"), md.version("sageattention")],
                "listed": sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] in names),
                "doctor": distribution_info("sageattention"),
            }))
            """
        )
    )
    assert answer == {
        "versions": ["2.8.3", "2.2.0"],
        "listed": ["flash-attn", "sageattention"],
        "doctor": {"installed": False, "name": "sageattention", "stand_in": True},
    }


@NO_UPSTREAM
def test_unknown_names_and_modules_are_refused_by_name():
    result = _python(
        """
        import flash_recipe
        assert flash_recipe.install_as_sageattention()
        import sageattention
        for statement in ("import sageattention.quant", "from sageattention import sageattn3_blackwell",
                          "sageattention.sageattn_qk_int8_pv_fp8_cuda_sm100",
                          "from sageattention.core import per_block_int8_triton"):
            try:
                exec(statement)
            except (ImportError, AttributeError) as exc:
                print(type(exc).__name__, "|", exc)
            else:
                raise SystemExit(statement + " did not raise")
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ModuleNotFoundError | ")
    assert (
        "does not provide the module sageattention.quant; it provides sageattention, sageattention.core" in (lines[0])
    )
    assert lines[1].startswith("ImportError | cannot import name 'sageattn3_blackwell'")  # Python's words
    assert lines[2].startswith("AttributeError | ")
    assert "does not provide sageattention.sageattn_qk_int8_pv_fp8_cuda_sm100" in lines[2]
    assert "sageattn_varlen" in lines[2] and "install the sageattention package for the rest" in lines[2]
    assert lines[3].startswith("ImportError | cannot import name 'per_block_int8_triton'")  # Python's words


@NO_UPSTREAM
def test_sageattention_core_gives_the_functions_and_the_probes():
    """``from sageattention.core import ...`` as scripts and ComfyUI nodes write it: the package's
    functions, and probes that report no GPU on this machine."""
    answer = _json(
        _python(
            """
            import json
            import flash_recipe
            assert flash_recipe.install_as_sageattention()
            import sageattention, sageattention.core
            from sageattention.core import sageattn, sageattn_qk_int8_pv_fp16_cuda, get_cuda_arch_versions
            from sageattention.core import SM80_ENABLED, SM89_ENABLED, SM90_ENABLED
            print(json.dumps({
                "same": [getattr(sageattention.core, n) is getattr(sageattention, n) for n in sageattention.__all__
                         if n != "__version__"],
                "functions": [sageattn.__module__, sageattn_qk_int8_pv_fp16_cuda.__name__],
                "probes": [get_cuda_arch_versions(), SM80_ENABLED, SM89_ENABLED, SM90_ENABLED],
            }))
            """
        )
    )
    assert answer["same"] and all(answer["same"])
    assert answer["functions"] == ["flash_recipe.sage", "sageattn_qk_int8_pv_fp16_cuda"]
    assert answer["probes"] == [[], False, False, False]


@pytest.mark.parametrize(
    "gpus,archs,probes",
    [
        ([(8, 6)], ["sm86"], (True, False, False)),
        ([(7, 5), (8, 9)], ["sm75", "sm89"], (True, True, True)),
        ([(7, 5)], ["sm75"], (False, False, False)),
        ([(9, 0), (12, 0)], ["sm90", "sm120"], (True, True, True)),
    ],
)
def test_core_probes_follow_the_visible_gpus(gpus, archs, probes, monkeypatch):
    """The probes as the GPUs would answer them. This machine has no GPU: torch.cuda's device
    queries are replaced by the listed compute capabilities (a mock of the driver only)."""
    from flash_recipe.sageattention import core

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: gpus[index])
    assert core.get_cuda_arch_versions() == archs
    found = (core.SM80_ENABLED, core.SM89_ENABLED, core.SM90_ENABLED)
    assert found == probes


@NO_UPSTREAM
def test_a_call_through_the_stand_in_is_8_bit_attention():
    """``sageattention.sageattn`` is flash_recipe's: within the method's bounds of fp32 attention."""
    result = _python(
        """
        import torch, flash_recipe
        assert flash_recipe.install_as_sageattention()
        from sageattention import sageattn
        from flash_recipe.testing.quantized import assert_method_accurate, realistic_inputs, unquantized
        q, k, v = realistic_inputs(1, 40, 72, 2, 1, 64, torch.float16, seed=3)
        with torch.no_grad():
            out = sageattn(q, k, v, tensor_layout="NHD", is_causal=True)
        assert out.shape == q.shape and out.dtype == torch.float16
        print(assert_method_accurate("sageattn", out, unquantized(q, k, v, True, 64**-0.5)))
        """
    )
    assert result.returncode == 0, result.stderr


def _fake_sageattention(root, init: str, version: str = "2.1.1"):
    """An installed SageAttention: the package and its dist-info (as pip leaves them)."""
    package = root / "sageattention"
    package.mkdir()
    (package / "__init__.py").write_text(init)
    info = root / f"sageattention-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sageattention\nVersion: {version}\n")
    (info / "top_level.txt").write_text("sageattention\n")
    return root


def test_a_working_sageattention_is_not_shadowed(tmp_path):
    root = _fake_sageattention(tmp_path, "def sageattn(*args, **kwargs):\n    return 'upstream'\n")
    result = _python(
        """
        import importlib.metadata as md, warnings, flash_recipe
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert flash_recipe.install_as_sageattention() is False
        print(caught[0].message)
        from sageattention import sageattn
        assert sageattn() == "upstream" and md.version("sageattention") == "2.1.1"
        assert flash_recipe.install_as_sageattention(force=True)
        import sageattention
        from sageattention import sageattn
        assert sageattention.__version__ == "2.2.0" and sageattn is flash_recipe.sage.sageattn
        assert md.version("sageattention") == "2.2.0"  # the stand-in answers first while installed
        """,
        root,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        "sageattention 2.1.1 is installed and imports; install_as_sageattention() leaves it in place "
        "(force=True replaces it in this process)"
    )


def test_a_broken_sageattention_is_replaced(tmp_path):
    root = _fake_sageattention(tmp_path, "from sageattention._qattn_sm80 import qk_int8_sv_f16_accum_f32_attn\n")
    result = _python(
        """
        import warnings, flash_recipe
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert flash_recipe.install_as_sageattention() is True
        print(caught[0].message)
        import sageattention
        assert sageattention.__version__ == "2.2.0"
        """,
        root,
    )
    assert result.returncode == 0, result.stderr
    assert "sageattention is installed but fails to import (ModuleNotFoundError" in result.stdout
    assert "flash_recipe stands in for it" in result.stdout


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="force must be a bool, got str"):
        flash_recipe.install_as_sageattention(force="yes")
    with pytest.raises(
        ValueError, match="package must be one of flash_attn, flash_attn_3, sageattention, got 'xformers'"
    ):
        alias.is_installed("xformers")


def test_exported_lazily():
    assert "install_as_sageattention" in flash_recipe.__all__
    assert flash_recipe.install_as_sageattention is alias.install_as_sageattention
    assert alias.SAGEATTENTION.provided == ("sageattention", "sageattention.core")


def test_a_call_as_comfyui_makes_it():
    """ComfyUI's ``attention_sage``: ``sageattn(q, k, v, attn_mask=mask, is_causal=False,
    tensor_layout="NHD")``, ``mask`` None without a mask (a real mask is refused by name, and
    ComfyUI then falls back to PyTorch for that call)."""
    q = torch.randn(1, 8, 2, 32, dtype=torch.float16)
    with torch.no_grad():
        assert sageattn(q, q, q, attn_mask=None, is_causal=False, tensor_layout="NHD").shape == q.shape
        with pytest.raises(NotImplementedError, match="attn_mask must be None"):
            sageattn(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool), tensor_layout="NHD")
