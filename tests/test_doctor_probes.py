"""The doctor's probes, on this machine for real: isolation, project detection, network, variables."""

from __future__ import annotations

import ast
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flash_recipe.env import commands, probes
from flash_recipe.env.project import probe_project

ENV_DIR = Path(probes.__file__).resolve().parent


def test_one_failing_probe_never_stops_the_others():
    def broken():
        raise OSError("driver exploded")

    facts = probes.collect(["platform", "env"], extra={"broken": broken})
    assert facts["broken"] == {"error": "OSError: driver exploded"}
    assert facts["platform"]["python_tag"] == f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert isinstance(facts["env"], dict)


def test_collect_rejects_unknown_probe_names():
    with pytest.raises(ValueError, match="names must be among"):
        probes.collect(["platform", "gpu"])


def test_all_probes_run_here_without_error():
    facts = probes.collect()
    errors = {name: f["error"] for name, f in facts.items() if "error" in f}
    assert errors == {}
    assert facts["torch"]["installed"] is True and facts["torch"]["build"] in ("cpu", "cuda", "rocm")
    assert set(facts["backends"]["explain"]) >= {"sdpa", "reference"}


def test_no_module_level_torch_import_in_env_package():
    """flash_recipe.env must import without torch: no module imports it at the top level."""
    for path in ENV_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("torch", "triton") for n in names), (
                f"{path.name} imports {names} at module level"
            )


def test_env_vars_are_read_verbatim(monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_FORCE_BUILD", "1")
    monkeypatch.setenv("MAX_JOBS", "3")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    env = probes.probe_env_vars()
    assert env["FLASH_ATTENTION_FORCE_BUILD"] == "1" and env["MAX_JOBS"] == "3" and "CUDA_HOME" not in env


def test_nvcc_probe_follows_cuda_home(monkeypatch, tmp_path):
    fake = tmp_path / "cuda" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    nvcc = probes.probe_nvcc()
    assert nvcc["path"] == str(fake) and nvcc["version"] == "12.4" and nvcc["cuda_home"] == str(tmp_path / "cuda")


@pytest.mark.parametrize(
    "files, installer",
    [
        ({"poetry.lock": ""}, "poetry"),
        ({"pyproject.toml": '[build-system]\nbuild-backend = "poetry.core.masonry.api"\n'}, "poetry"),
        ({"uv.lock": ""}, "uv"),
        ({"pyproject.toml": '[project]\nname = "x"\n[tool.uv]\ndev-dependencies = []\n'}, "uv"),
        ({"pyproject.toml": '[project]\nname = "x"\n'}, "pip"),
        ({}, "pip"),
    ],
    ids=["poetry-lock", "poetry-backend", "uv-lock", "tool-uv", "plain-pep621", "no-project"],
)
def test_project_installer_detection(tmp_path, monkeypatch, files, installer):
    monkeypatch.delenv("UV", raising=False)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert probe_project(str(tmp_path))["installer"] == installer


@pytest.mark.parametrize(
    "text, declared",
    [
        ('[project]\nname = "x"\ndependencies = ["flash-attn>=2.8; sys_platform == \'linux\'"]\n', True),
        ('[project]\nname = "x"\n[project.optional-dependencies]\nfa = ["flash_attn==2.8.3"]\n', True),
        ('[tool.poetry.dependencies]\npython = "^3.10"\nflash-attn = { url = "https://x/y.whl" }\n', True),
        (
            '[project]\nname = "x"\ndescription = "drop-in for flash-attn users"\ndependencies = ["flash-recipe"]\n',
            False,
        ),
    ],
    ids=["pep621", "extra", "poetry-table", "mention-only"],
)
def test_flash_attn_declaration(tmp_path, text, declared):
    (tmp_path / "pyproject.toml").write_text(text)
    assert probe_project(str(tmp_path))["declares_flash_attn"] is declared


def test_network_probe_against_a_loopback_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - http.server's naming
            self.send_response(404 if "missing" in self.path else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert probes.probe_network(base + "/ok", timeout=5)["reachable"] is True
        missing = probes.probe_network(base + "/missing.whl", timeout=5)
        assert missing["reachable"] is True and missing["status"] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_max_jobs_follows_upstreams_rule():
    assert commands.max_jobs({"platform": {"cpu_count": 64, "mem_available_gib": 40.0}}) == 4
    assert commands.max_jobs({"platform": {"cpu_count": 8, "mem_available_gib": 500.0}}) == 4
    assert commands.max_jobs({"platform": {"cpu_count": 2, "mem_available_gib": 3.0}}) == 1


def test_commands_reject_unknown_installer():
    with pytest.raises(ValueError, match="installer must be one of pip, uv, poetry"):
        commands.install_flash_recipe("conda")


def test_torch_index_follows_torch_build():
    assert commands.torch_index_url({"torch": {"cuda": "12.8"}}) == "https://download.pytorch.org/whl/cu128"
    assert commands.torch_index_url({"torch": {"hip": "6.3.42131"}}) == "https://download.pytorch.org/whl/rocm6.3"
    assert commands.torch_index_url({"torch": {}, "gpus": {}}) == "https://download.pytorch.org/whl/cpu"
    assert commands.torch_index_url({"torch": {}, "gpus": {"driver": "570", "driver_cuda": "12.8"}}).endswith("/cu128")


def test_uninstall_drops_the_cached_wheel_per_installer():
    assert (
        commands.uninstall_flash_attn("pip")
        == "python -m pip uninstall -y flash-attn && python -m pip cache remove flash_attn"
    )
    assert commands.uninstall_flash_attn("uv") == "uv pip uninstall flash-attn && uv cache clean flash-attn"
    assert commands.uninstall_flash_attn("poetry", drop_cache=False) == "poetry run pip uninstall -y flash-attn"


@pytest.mark.slow
def test_triton_compile_check_builds_for_sm80_without_a_gpu():
    """The compile probe the doctor runs on a GPU machine, pointed at sm80 here (Triton compiles
    for a named target without a GPU)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["PYTHONPATH"] = str(ENV_DIR.parents[1])
    code = "import json; from flash_recipe.env import probes; print(json.dumps(probes.triton_compile_check('sm80')))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["ok"] is True, row
    assert 0 < row["shared_bytes"] <= row["shared_limit"] == 166912


def test_triton_compile_check_says_when_the_interpreter_is_on(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    row = probes.triton_compile_check("sm90")
    assert row["ok"] is None and "TRITON_INTERPRET" in row["error"]


def test_sdpa_probe_without_a_gpu_runs_nothing():
    """This machine for real: no GPU, so the probe names why and records no kernel."""
    import torch

    out = probes.probe_sdpa()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests cover the live probe")
    assert out == {"device": None, "kernels": {}, "reason": "no GPU that torch can use"}


def test_sdpa_kernel_check_records_torchs_refusal_for_real():
    """The check the live probe runs on a GPU, run here on the CPU for real: torch has a CPU flash
    kernel but no CPU memory-efficient one, so the second restriction fails with torch's error."""
    kernels = probes.sdpa_kernel_check("cpu")
    assert kernels["FLASH_ATTENTION"]["ok"] is True and kernels["FLASH_ATTENTION"]["error"] is None
    refused = kernels["EFFICIENT_ATTENTION"]
    assert refused["ok"] is False and refused["error"].startswith("RuntimeError: ")
    assert not any("Triggered internally" in w for w in refused["warnings"])


def test_no_kernel_pattern_matches_torchs_message():
    import re

    # the message as torch's sdp_utils.cpp spells it (two spaces), and as users paste it
    for text in ("No available kernel.  Aborting execution.", "RuntimeError: No available kernel. Aborting execution."):
        assert re.search(probes.NO_KERNEL, text)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            (
                '[project]\nname = "x"\n[[tool.uv.index]]\nname = "pytorch-cu124"\n'
                'url = "https://download.pytorch.org/whl/cu124"\nexplicit = true\n'
                '[tool.uv.sources]\ntorch = [{ index = "pytorch-cu124", marker = "sys_platform == \'linux\'" }]\n'
            ),
            {"name": "pytorch-cu124", "url": "https://download.pytorch.org/whl/cu124", "pinned": True},
        ),
        (
            (
                '[tool.poetry.dependencies]\ntorch = { version = "^2.6", source = "torchsrc" }\n'
                '[[tool.poetry.source]]\nname = "other"\nurl = "https://pypi.example/simple"\n'
                '[[tool.poetry.source]]\nname = "torchsrc"\n'
                'url = "https://user:secret@mirror.example/whl/cu126"\npriority = "explicit"\n'
            ),
            {"name": "torchsrc", "url": "https://mirror.example/whl/cu126", "pinned": True},
        ),
        (
            '[[tool.uv.index]]\nname = "pt"\nurl = "https://download.pytorch.org/whl/cpu"\n',
            {"name": "pt", "url": "https://download.pytorch.org/whl/cpu", "pinned": False},
        ),
        ('[project]\nname = "x"\ndependencies = ["torch"]\n', None),
    ],
    ids=["uv-sources", "poetry-source-credentials-dropped", "uv-index-by-host", "none"],
)
def test_project_torch_index(tmp_path, text, expected):
    if sys.version_info < (3, 11):
        pytest.skip("reading the index needs tomllib (Python 3.11+)")
    (tmp_path / "pyproject.toml").write_text(text)
    assert probe_project(str(tmp_path))["torch_index"] == expected


def test_torch_probe_records_who_installed_it():
    torch = probes.probe_torch()
    from flash_recipe.env.distinfo import distribution_info

    assert torch["installer"] == distribution_info("torch")["installer"]
    assert isinstance(probes.probe_platform()["conda"], bool)


def test_compile_probe_explains_an_architecture_without_a_table():
    """No GPU here: the probe is called with the architecture a GPU would report."""
    from flash_recipe.env.probes import triton_compile_check

    row = triton_compile_check("sm130")
    assert row["ok"] is None and "no configuration table of its own" in row["error"]
    assert "sm86" in row["error"] and "101376" in row["error"] and "SDPA otherwise" in row["error"]
    for old_arch in ("sm75", "sm61"):
        old = triton_compile_check(old_arch)
        assert old["ok"] is False and "sm80 or newer" in old["error"] and old_arch in old["error"]


def test_triton_probe_reads_the_triton_windows_distribution(monkeypatch):
    """On Windows the ``triton`` module comes from the triton-windows distribution; which
    distributions are installed is stood in for here, since a Windows package cannot be."""
    installed = {"triton-windows": {"installed": True, "version": "3.8.0.post29"}}
    monkeypatch.setattr(probes, "distribution_info", lambda name: installed.get(name, {"installed": False}))
    facts = probes.probe_triton()
    assert facts["installed"] and facts["version"] == "3.8.0.post29"
