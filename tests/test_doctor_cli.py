"""``flash-recipe doctor`` and ``flash-recipe recipe`` as a user runs them: in a subprocess, here
(CPU torch, no GPU) and in a fresh venv that has no torch at all; option handling in-process
through ``flash_recipe.tools.cli.main`` (same code path, without paying for a torch import each time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli(
    *args: str, python: str = sys.executable, cwd: Path = ROOT, env_extra: dict | None = None, stdin: str | None = None
):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.update(env_extra or {})
    return subprocess.run(
        [python, "-m", "flash_recipe", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


def main(capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process; returns (exit status, stdout, stderr)."""
    from flash_recipe.tools.cli import main as cli_main

    try:
        code = cli_main(list(args))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def doctor_json(capsys):
    code, out, err = main(capsys, "doctor", "--json", "--flash-attn-wheel", "--flex")
    assert code == 0, err
    return json.loads(out)


def test_doctor_here_is_healthy_with_sections_in_order(tmp_path):
    proc = cli("doctor", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    order = [
        out.index(s) for s in ("FINDINGS", "COUPLING", "MACHINE", "UPSTREAM FLASH-ATTN\n", "FLASH_RECIPE BACKENDS")
    ]
    assert order == sorted(order)
    assert "none: no known install failure applies" in out
    assert "Python ABI" in out and "C++11 ABI" in out
    assert "Traceback" not in proc.stderr


def test_doctor_json_here(doctor_json):
    import platform

    import torch

    assert doctor_json["healthy"] is True
    c = doctor_json["coupling"]
    assert c["python_abi"] == f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert c["torch"] == torch.__version__
    assert c["cxx11abi"] == ("TRUE" if torch._C._GLIBCXX_USE_CXX11_ABI else "FALSE")
    assert c["platform"] == f"linux_{platform.machine()}"
    wheel = doctor_json["upstream_wheel"]
    expected = "no-gpu-torch" if torch.version.cuda is None else wheel["status"]
    assert wheel["status"] == expected
    assert doctor_json["flex"]["statement"].startswith("FlexAttention has no ahead-of-time build step")
    assert set(doctor_json["facts"]) >= {
        "platform",
        "torch",
        "gpus",
        "nvcc",
        "triton",
        "build",
        "env",
        "flash_attn",
        "flex",
        "backends",
        "project",
    }


def test_doctor_flash_attn_wheel_text_names_file_or_says_why(capsys):
    code, out, _ = main(capsys, "doctor", "--flash-attn-wheel", "2.8.3")
    assert "UPSTREAM FLASH-ATTN 2.8.3 WHEEL" in out
    assert "status:" in out and "nearest published: flash_attn-2.8.3+cu12torch2.8" in out


def test_doctor_reads_a_log_and_exits_1(tmp_path, capsys, monkeypatch):
    import io

    monkeypatch.chdir(tmp_path)
    log = tmp_path / "install.log"
    log.write_text(
        "  Getting requirements to build wheel: started\n      ModuleNotFoundError: No module named 'torch'\n"
    )
    code, out, _ = main(capsys, "doctor", "--log", str(log), "--installer", "pip")
    assert code == 1
    assert "[error] build-isolation-no-torch" in out
    # this machine's torch is CPU-only: the fix is a CUDA torch, not a build without isolation
    assert "fix (recipes/torch-index-pip):" in out and "--no-build-isolation" not in out
    monkeypatch.setattr(sys, "stdin", io.StringIO(log.read_text()))
    code, out, _ = main(capsys, "doctor", "--json", "--log", "-")
    assert code == 1 and json.loads(out)["findings"][0]["rule"] == "build-isolation-no-torch"


def test_doctor_checks_a_wheel_file(tmp_path, capsys, monkeypatch):
    import zipfile

    path = tmp_path / "flash_attn-2.8.2+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            "flash_attn-2.8.3.dist-info/METADATA", "Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n"
        )
    monkeypatch.chdir(tmp_path)
    code, out, _ = main(capsys, "doctor", "--json", "--wheel", str(path))
    report = json.loads(out)
    assert code == 1
    assert [f["rule"] for f in report["findings"] if f["severity"] == "error"] == ["wheel-version-mismatch"]
    assert report["wheel_file"]["metadata_version"] == "2.8.3"


def test_doctor_rejects_an_unknown_installer(capsys):
    code, _, err = main(capsys, "doctor", "--installer", "conda")
    assert code == 2 and "invalid choice" in err


@pytest.fixture(scope="module")
def no_torch_python(tmp_path_factory):
    """A fresh venv without pip and without torch; flash_recipe comes from PYTHONPATH."""
    root = tmp_path_factory.mktemp("venv-no-torch")
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root)
    python = root / "bin" / "python"
    check = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert check.returncode != 0
    return str(python)


def test_doctor_without_torch_exits_cleanly_with_a_useful_report(no_torch_python, tmp_path):
    proc = cli("doctor", "--flash-attn-wheel", python=no_torch_python, cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1
    out = proc.stdout
    assert "[error] torch-missing" in out
    assert "python -m pip install torch --index-url https://download.pytorch.org/whl/" in out
    assert "torch: not installed" in out
    assert "status: no-torch" in out


def test_doctor_json_without_torch(no_torch_python, tmp_path):
    proc = cli("doctor", "--json", python=no_torch_python, cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert report["healthy"] is False
    assert report["facts"]["torch"] == {"installed": False, "version": None}
    assert "error" in report["facts"]["backends"]  # the backends probe failed alone, the rest ran
    assert report["facts"]["platform"]["python_tag"].startswith("cp3")


def test_recipe_detects_installer_from_project_files(tmp_path, capsys, monkeypatch):
    (tmp_path / "poetry.lock").write_text("")
    monkeypatch.chdir(tmp_path)
    code, out, _ = main(capsys, "recipe")
    assert code == 0
    # not on the configured index: the checkout these tests run from, or the repository for a wheel
    assert "installer: poetry" in out and "poetry add flash-recipe" not in out
    assert f"poetry add {ROOT}" in out or 'poetry add "git+https://github.com/flash-recipe/flash-recipe"' in out
    uv_dir = tmp_path / "uvproj"
    uv_dir.mkdir()
    (uv_dir / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.uv]\n')
    result = json.loads(main(capsys, "recipe", "--json", "--project", str(uv_dir))[1])
    assert (
        result["installer"] == "uv"
        and result["recipe"] == "uv-project"
        and "uv add flash-recipe" not in result["steps"]
    )


def test_recipe_installer_override_and_no_torch(no_torch_python, tmp_path):
    proc = cli("recipe", "--installer", "pip", "--json", python=no_torch_python, cwd=tmp_path)
    result = json.loads(proc.stdout)
    assert result["recipe"] == "torch-index-pip"
    assert result["steps"][0].startswith("python -m pip install torch --index-url https://download.pytorch.org/whl/")
    assert result["steps"][1] == f"python -m pip install {ROOT}"


def test_doctor_bad_version_and_missing_log_are_usage_errors(capsys, tmp_path):
    code, _, err = main(capsys, "doctor", "--flash-attn-wheel", "newest")
    assert code == 2 and "--flash-attn-wheel: flash-attn version must look like 2.8.3" in err
    code, _, err = main(capsys, "doctor", "--log", str(tmp_path / "absent.log"))
    assert code == 2 and "absent.log" in err


def test_doctor_with_an_old_flash_attn_version_does_not_break_rules(capsys):
    code, out, _ = main(capsys, "doctor", "--json", "--flash-attn-wheel", "2.5.8")
    report = json.loads(out)
    assert report["upstream_wheel"]["status"] in ("no-gpu-torch", "unknown-release")
    assert not any("could not be evaluated" in f["title"] for f in report["findings"])


def test_report_of_a_gpu_machine_from_injected_facts():
    """Injected facts (no GPU here): an H100 with a hollow flash-attn; the terminal report shows
    the finding first, the coupling row, the GPU line and the compile check."""
    import argparse

    from test_doctor_rules import gpu_facts

    from flash_recipe.env.doctor import diagnose, format_report

    facts = gpu_facts(project={"installer": "uv", "installer_reason": "uv.lock or [tool.uv] in pyproject.toml"})
    facts["flash_attn"].update(
        loads=False,
        module_error="ModuleNotFoundError: No module named 'flash_attn_2_cuda'",
        wheel_tags=["py3-none-any"],
    )
    facts["triton"]["compile"] = {
        "arch": "sm90",
        "ok": True,
        "shared_bytes": 98304,
        "shared_limit": 232448,
        "seconds": 1.2,
    }
    args = argparse.Namespace(
        installer=None, log=None, wheel=None, flash_attn_wheel="2.8.3", flex=True, project=None, online=False
    )
    report = diagnose(args, facts=facts)
    assert report["healthy"] is False and report["installer"] == "uv"
    text = format_report(report)
    assert text.index("[error] hollow-package") < text.index("COUPLING")
    assert "uv pip uninstall flash-attn && uv cache clean flash-attn && uv add" in text
    assert "cp312       2.8.0+cu128  CUDA 12.8  TRUE       linux_x86_64" in text
    assert "GPU NVIDIA H100 80GB HBM3: sm90, 232448 bytes shared memory per block" in text
    assert "compiles flash_recipe's forward kernel for sm90: 98304 of 232448 bytes" in text
    assert "status: published: this exact wheel is a published release asset" in text
