"""One test (at least) per doctor rule, firing and staying silent.

Where the situation can be built on this CPU machine it is built for real: environment variables
through monkeypatch, a fake flash_attn distribution (dist-info + package on a tmp sys.path) whose
compiled-module import fails, a renamed wheel file, real install-log text captured from pip,
the real probes of this machine. GPU facts (device, compute capability, driver, a CUDA build of
torch) cannot exist here: those tests inject probe facts, built from ``gpu_facts()`` below, and
say so.
"""

from __future__ import annotations

import copy
import json
import zipfile
from pathlib import Path

import pytest

from flash_recipe.env import probes
from flash_recipe.env.project import probe_project
from flash_recipe.env.rules import RULES, Context, Finding, cited_recipes, evaluate

# Captured from `pip download --no-deps --no-binary :all: flash-attn==2.8.3` on this project's
# CPU machine (pip 23.2.1, PEP 517 build with isolation), trimmed to the lines that matter.
ISOLATED_BUILD_LOG = """\
Collecting flash-attn==2.8.3
  Downloading flash_attn-2.8.3.tar.gz (8.4 MB)
  Installing build dependencies: started
  Installing build dependencies: finished with status 'done'
  Getting requirements to build wheel: started
  Getting requirements to build wheel: finished with status 'error'
  error: subprocess-exited-with-error
      File "/tmp/pip-build-env-r74578xa/overlay/lib/python3.11/site-packages/setuptools/build_meta.py", line 317, in run_setup
        exec(code, locals())  # noqa: S102 # exec is intentional here
      File "<string>", line 22, in <module>
      ModuleNotFoundError: No module named 'torch'
"""

# Captured from a --no-build-isolation build of the same sdist against CPU torch 2.13.0 (legacy
# setup.py path), trimmed.
NO_CUDA_HOME_LOG = """\
  setup.py:106: UserWarning: flash_attn was requested, but nvcc was not found.  Are you sure your environment has nvcc available?
      raise OSError('CUDA_HOME environment variable is not set. '
  OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install root.
"""

CPU_TORCH_LOG = """\
      File "/tmp/pip-req-build-6wa4awsd/setup.py", line 456, in get_wheel_url
        torch_cuda_version = parse(torch.version.cuda)
      packaging.version.InvalidVersion: Invalid version: None
"""


def gpu_facts(**overrides):
    """Injected facts of a healthy GPU machine: H100 (sm90), driver 570, torch 2.8.0+cu128 with the
    C++11 ABI, Python 3.12, flash-attn 2.8.3 installed from its published wheel and loading, nvcc
    12.8, ninja and every build tool present. No GPU exists on the test machine."""
    name = "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    from flash_recipe.env.wheels import parse_wheel_filename

    facts = {
        "platform": {
            "python": "3.12.7",
            "python_tag": "cp312",
            "wheel_platform": "linux_x86_64",
            "cpu_count": 32,
            "mem_available_gib": 200.0,
            "os": "Linux",
            "machine": "x86_64",
        },
        "torch": {
            "installed": True,
            "version": "2.8.0+cu128",
            "cuda": "12.8",
            "hip": None,
            "cxx11abi": True,
            "build": "cuda",
            "cuda_available": True,
            "device_count": 1,
        },
        "gpus": {
            "devices": [{"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "shared_memory_per_block": 232448}],
            "driver": "570.86.15",
            "driver_cuda": "12.8",
            "source": "torch",
        },
        "nvcc": {
            "path": "/usr/local/cuda/bin/nvcc",
            "version": "12.8",
            "cuda_home": "/usr/local/cuda",
            "on_path": True,
        },
        "triton": {"installed": True, "version": "3.4.0", "target": "cuda:90"},
        "build": {"ninja": "/usr/bin/ninja", "ninja_version": "1.11.1", "packages": {}, "missing": []},
        "env": {},
        "flash_attn": {
            "installed": True,
            "name": "flash_attn",
            "version": "2.8.3",
            "installer": "pip",
            "direct_url": f"https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/{name}",
            "wheel_filename": name,
            "wheel_name_parts": parse_wheel_filename(name),
            "wheel_tags": ["cp312-cp312-linux_x86_64"],
            "module_error": None,
            "package_error": None,
            "loads": True,
        },
        "flex": {"module": True, "torch_ok": True, "device": True},
        "backends": {"explain": {"flash_attn": None, "triton": None, "sdpa": None, "reference": None}},
    }
    for key, value in overrides.items():
        probe, _, field = key.partition("__")
        if field:
            facts[probe][field] = value
        else:
            facts[probe] = value
    return facts


def rules_fired(ctx: Context) -> dict[str, Finding]:
    return {f.rule: f for f in evaluate(ctx)}


def this_machine(**extra) -> dict:
    """The real probes of this machine (CPU torch, no GPU)."""
    facts = probes.collect()
    facts.update(extra)
    return facts


# -- fake upstream flash-attn distributions, built for real on a tmp sys.path --------------------
def make_flash_attn(
    tmp_path: Path, monkeypatch, *, cuda_module: str | None, tag: str, direct_url: str | None = None
) -> Path:
    """Install a fake flash-attn 2.8.3 (dist-info + package) into ``tmp_path/site`` and put it on
    sys.path and PYTHONPATH. ``cuda_module``: source of ``flash_attn_2_cuda.py`` or None for none."""
    site = tmp_path / "site"
    pkg = site / "flash_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '2.8.3'\nimport flash_attn_2_cuda  # noqa: F401\n")
    files = ["flash_attn/__init__.py"]
    if cuda_module is not None:
        (site / "flash_attn_2_cuda.py").write_text(cuda_module)
        files.append("flash_attn_2_cuda.py")
    info = site / "flash_attn-2.8.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n")
    (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n")
    (info / "INSTALLER").write_text("pip\n")
    if direct_url:
        (info / "direct_url.json").write_text(json.dumps({"url": direct_url, "archive_info": {}}))
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files + ["flash_attn-2.8.3.dist-info/METADATA"]))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


# -- no false alarms ---------------------------------------------------------------------------
def test_this_machine_is_healthy_and_quiet():
    """Real probes here: CPU torch, no GPU, no flash-attn. Nothing should be reported."""
    ctx = Context(facts=this_machine(), installer="pip")
    assert evaluate(ctx) == []


def test_healthy_gpu_machine_is_quiet():
    """Injected facts (no GPU here): a healthy H100 machine with a working flash-attn."""
    assert evaluate(Context(facts=gpu_facts(), installer="pip", flash_attn_version="2.8.3")) == []


# -- 1 -----------------------------------------------------------------------------------------
def test_build_isolation_from_real_log():
    found = rules_fired(Context(facts=gpu_facts(), log=ISOLATED_BUILD_LOG, installer="pip"))
    f = found["build-isolation-no-torch"]
    assert f.severity == "error" and f.failure == 1
    assert "No module named 'torch'" in f.evidence[0]
    assert f.recipe == "pip-no-build-isolation"
    assert "--no-build-isolation flash-attn==2.8.3" in f.command


def test_build_isolation_predicted_for_poetry_project_declaring_flash_attn(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["flash-attn>=2.8"]\n[tool.poetry]\n'
    )
    project = probe_project(str(tmp_path))
    facts = gpu_facts(flash_attn={"installed": False})
    f = rules_fired(Context(facts=facts, installer=project["installer"], project=project))["build-isolation-no-torch"]
    assert f.severity == "warning" and "Poetry" in f.evidence[0]
    assert f.command.startswith('poetry add "https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/')


def test_build_isolation_quiet_for_uv_project_with_match_runtime(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["flash-attn"]\n'
        '[tool.uv.extra-build-dependencies]\nflash-attn = [{ requirement = "torch", match-runtime = true }]\n'
    )
    project = probe_project(str(tmp_path))
    assert project["installer"] == "uv" and project["uv_flash_attn_build_config"]
    facts = gpu_facts(flash_attn={"installed": False})
    assert "build-isolation-no-torch" not in rules_fired(Context(facts=facts, installer="uv", project=project))


def test_runtime_no_module_torch_is_not_a_build_isolation_finding():
    log = "Traceback (most recent call last):\n  File \"train.py\", line 1\nModuleNotFoundError: No module named 'torch'\n"
    assert "build-isolation-no-torch" not in rules_fired(Context(facts=gpu_facts(), log=log))


# -- 2 -----------------------------------------------------------------------------------------
def test_build_tools_missing_from_real_environment(monkeypatch):
    """Real probe of this machine's build tools and variables (a flash-attn build in play), with
    injected CUDA torch facts: without a GPU build of torch no flash-attn build can go ahead."""
    monkeypatch.setenv("FLASH_ATTENTION_FORCE_BUILD", "TRUE")
    facts = this_machine(torch=gpu_facts()["torch"])
    missing = facts["build"]["missing"]
    found = rules_fired(Context(facts=facts, installer="pip"))
    if missing:
        f = found["build-tools-missing"]
        assert all(name in f.evidence[0] for name in missing)
        assert f.command == "python -m pip install packaging wheel setuptools psutil ninja"
    else:
        assert "build-tools-missing" not in found


def test_build_tools_not_reported_for_a_cpu_torch(monkeypatch):
    """This machine for real: CPU torch, so no flash-attn build can happen and tools do not matter."""
    monkeypatch.setenv("FLASH_ATTENTION_FORCE_BUILD", "TRUE")
    assert "build-tools-missing" not in rules_fired(Context(facts=this_machine()))


def test_build_tools_missing_from_log():
    log = "  File \"setup.py\", line 12\n    ModuleNotFoundError: No module named 'psutil'\n"
    f = rules_fired(Context(facts=gpu_facts(), log=log, installer="uv"))["build-tools-missing"]
    assert f.severity == "error" and f.command.startswith("uv pip install packaging")


# -- 3 and 4: undefined symbols, for real through a fake compiled module ------------------------
def test_torch_mismatch_from_a_failing_compiled_module(tmp_path, monkeypatch):
    make_flash_attn(
        tmp_path,
        monkeypatch,
        tag="cp311-cp311-linux_x86_64",
        cuda_module="raise ImportError('/site/flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n",
    )
    fa = probes.probe_flash_attn()
    assert fa["installed"] and fa["loads"] is False
    assert "undefined symbol: _ZN3c104cuda9SetDeviceEi" in fa["module_error"]
    found = rules_fired(Context(facts=this_machine(flash_attn=fa)))
    assert found["torch-version-mismatch"].severity == "error"
    assert "cxx11-abi-mismatch" not in found


def test_torch_mismatch_from_wheel_name():
    """Injected: a wheel for torch 2.7 under torch 2.8 (no GPU here to load it)."""
    from flash_recipe.env.wheels import parse_wheel_filename

    name = "flash_attn-2.8.3+cu12torch2.7cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    facts = gpu_facts()
    facts["flash_attn"].update(wheel_filename=name, wheel_name_parts=parse_wheel_filename(name))
    f = rules_fired(Context(facts=facts))["torch-version-mismatch"]
    assert "torch 2.7" in f.evidence[0] and f.recipe == "upstream-flash-attn"
    assert "cu12torch2.8cxx11abiTRUE-cp312" in f.command


def test_abi_mismatch_from_a_failing_compiled_module(tmp_path, monkeypatch):
    # the symbol upstream's publish workflow quotes for a non-C++11-ABI build on a C++11 torch
    make_flash_attn(
        tmp_path,
        monkeypatch,
        tag="cp311-cp311-linux_x86_64",
        cuda_module="raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2ENS_14SourceLocationESs')\n",
    )
    found = rules_fired(Context(facts=this_machine(flash_attn=probes.probe_flash_attn())))
    assert found["cxx11-abi-mismatch"].severity == "error"
    assert "torch-version-mismatch" not in found


def test_abi_mismatch_from_wheel_name_and_cxx11_symbol():
    """Injected: an ABI-FALSE wheel under a C++11-ABI torch."""
    from flash_recipe.env.wheels import parse_wheel_filename

    name = "flash_attn-2.8.3+cu12torch2.8cxx11abiFALSE-cp312-cp312-linux_x86_64.whl"
    facts = gpu_facts()
    facts["flash_attn"].update(
        wheel_filename=name,
        wheel_name_parts=parse_wheel_filename(name),
        loads=False,
        module_error="ImportError: undefined symbol: _ZNK3c1010TensorImpl4sizeB5cxx11Ev",
    )
    f = rules_fired(Context(facts=facts))["cxx11-abi-mismatch"]
    assert len(f.evidence) == 2 and "cxx11abiTRUE" in f.command


# -- 5 and 6 -----------------------------------------------------------------------------------
def test_nvcc_missing_from_real_log():
    f = rules_fired(Context(facts=gpu_facts(), log=NO_CUDA_HOME_LOG))["nvcc-missing"]
    assert f.severity == "error" and len(f.evidence) == 2


def test_nvcc_missing_when_a_source_build_is_ahead():
    """Injected: CUDA torch 2.9 (no published wheel), no nvcc anywhere."""
    facts = gpu_facts(
        torch__version="2.9.0+cu128",
        nvcc={"path": None, "version": None, "cuda_home": None, "on_path": False},
        flash_attn={"installed": False},
    )
    found = rules_fired(Context(facts=facts, flash_attn_version="2.8.3"))
    assert "no nvcc" in found["nvcc-missing"].evidence[0]
    assert "cuda-nvcc=12.8" in found["nvcc-missing"].command
    assert "no-prebuilt-wheel" in found


def test_nvcc_quiet_when_the_published_wheel_fits():
    facts = gpu_facts(
        nvcc={"path": None, "version": None, "cuda_home": None, "on_path": False}, flash_attn={"installed": False}
    )
    assert "nvcc-missing" not in rules_fired(Context(facts=facts, flash_attn_version="2.8.3"))


def test_nvcc_torch_cuda_mismatch_with_this_machines_real_nvcc():
    """The real nvcc probe of this machine, with injected CUDA 12.8 torch 2.10 facts."""
    nvcc = probes.probe_nvcc()
    facts = gpu_facts(torch__version="2.10.0+cu128", nvcc=nvcc, flash_attn={"installed": False})
    found = rules_fired(Context(facts=facts, flash_attn_version="2.8.3"))
    if nvcc["version"] and nvcc["version"].split(".")[0] != "12":
        assert f"nvcc is CUDA {nvcc['version']}" in found["nvcc-torch-cuda-mismatch"].evidence[0]
    else:
        assert "nvcc-torch-cuda-mismatch" not in found


def test_nvcc_torch_cuda_mismatch_from_log():
    log = "RuntimeError: The detected CUDA version (12.1) mismatches the version that was used to compile\nPyTorch (11.7). Please make sure to use the same CUDA versions.\n"
    assert rules_fired(Context(facts=gpu_facts(), log=log))["nvcc-torch-cuda-mismatch"].severity == "error"


# -- 7 -----------------------------------------------------------------------------------------
def test_compile_oom_from_max_jobs(monkeypatch):
    """Real probes (cores, free memory) with MAX_JOBS set far above what memory allows."""
    monkeypatch.setenv("MAX_JOBS", "64")
    monkeypatch.setenv("FLASH_ATTENTION_FORCE_BUILD", "TRUE")
    f = rules_fired(Context(facts=this_machine()))["compile-oom"]
    assert "MAX_JOBS=64" in f.evidence[0]
    if probes.probe_torch().get("build") == "cpu":  # no build proposed on a CPU-only torch: a CUDA torch first
        assert "flash-attn needs a CUDA build of torch" in f.command and "FORCE_BUILD" not in f.command
    else:
        assert "FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS=" in f.command
    gpu = rules_fired(Context(facts=gpu_facts(env={"MAX_JOBS": "64", "FLASH_ATTENTION_FORCE_BUILD": "TRUE"})))
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS=" in gpu["compile-oom"].command


def test_compile_oom_quiet_with_a_sane_max_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "1")
    monkeypatch.setenv("FLASH_ATTENTION_FORCE_BUILD", "TRUE")
    facts = this_machine()
    facts["build"]["ninja"] = facts["build"]["ninja"] or "/usr/bin/ninja"
    assert "compile-oom" not in rules_fired(Context(facts=facts))


def test_compile_oom_from_log():
    log = "c++: fatal error: Killed signal terminated program cc1plus\ncompilation terminated.\n"
    assert rules_fired(Context(facts=gpu_facts(), log=log))["compile-oom"].severity == "error"


# -- 8 and 11: what setup.py does when its download fails -----------------------------------------
PUBLISHED_URL = "https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
UNPUBLISHED_URL = "https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/flash_attn-2.8.3+cu12torch2.9cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"


def test_download_blocked_when_published_wheel_fell_back():
    log = f"Guessing wheel URL:  {PUBLISHED_URL}\nPrecompiled wheel not found. Building from source...\n"
    found = rules_fired(Context(facts=gpu_facts(), log=log))
    assert found["wheel-download-blocked"].severity == "error"
    assert "no-prebuilt-wheel" not in found


def test_no_prebuilt_wheel_when_unpublished_wheel_fell_back():
    log = f"Guessing wheel URL:  {UNPUBLISHED_URL}\nPrecompiled wheel not found. Building from source...\n"
    found = rules_fired(Context(facts=gpu_facts(), log=log))
    assert "never published" in found["no-prebuilt-wheel"].evidence[0]
    assert "wheel-download-blocked" not in found


def test_download_blocked_from_a_real_unreachable_host():
    """The real network probe against a loopback port nothing listens on."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    net = probes.probe_network(f"http://127.0.0.1:{port}/release", timeout=2)
    assert net["reachable"] is False
    facts = gpu_facts(network=net, flash_attn={"installed": False})
    f = rules_fired(Context(facts=facts, flash_attn_version="2.8.3"))["wheel-download-blocked"]
    assert f.severity == "warning" and "curl -LO" in f.command


def test_no_prebuilt_wheel_for_new_torch_names_nearest():
    """Injected: CUDA torch 2.9 on Python 3.12 asks for flash-attn 2.8.3."""
    facts = gpu_facts(torch__version="2.9.1+cu128", flash_attn={"installed": False})
    f = rules_fired(Context(facts=facts, flash_attn_version="2.8.3"))["no-prebuilt-wheel"]
    assert "torch2.9" in f.evidence[0]
    assert "cu12torch2.8cxx11abiTRUE-cp312" in f.note


# -- 9 -----------------------------------------------------------------------------------------
def test_renamed_wheel_file_is_caught(tmp_path):
    from flash_recipe.env.wheels import inspect_wheel_file

    path = tmp_path / "flash_attn-2.8.4+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            "flash_attn-2.8.3.dist-info/METADATA", "Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n"
        )
    f = rules_fired(Context(facts=gpu_facts(), wheel=inspect_wheel_file(str(path))))["wheel-version-mismatch"]
    assert "2.8.4" in f.evidence[0] and "2.8.3" in f.evidence[0]


def test_published_wheel_file_with_local_label_is_fine(tmp_path):
    from flash_recipe.env.wheels import inspect_wheel_file

    path = tmp_path / "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            "flash_attn-2.8.3.dist-info/METADATA", "Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n"
        )
    assert "wheel-version-mismatch" not in rules_fired(Context(facts=gpu_facts(), wheel=inspect_wheel_file(str(path))))


# -- 10 ----------------------------------------------------------------------------------------
def test_hollow_package_for_real(tmp_path, monkeypatch):
    make_flash_attn(tmp_path, monkeypatch, cuda_module=None, tag="py3-none-any")
    fa = probes.probe_flash_attn()
    assert fa["module_error"] == "ModuleNotFoundError: No module named 'flash_attn_2_cuda'"
    assert fa["wheel_tags"] == ["py3-none-any"]
    f = rules_fired(Context(facts=this_machine(flash_attn=fa)))["hollow-package"]
    assert f.severity == "error" and len(f.evidence) == 2
    assert f.command.startswith("python -m pip uninstall -y flash-attn")
    # the same hollow install on a GPU machine (injected facts) gets the published wheel
    gpu = rules_fired(Context(facts=gpu_facts(flash_attn=fa, platform__python="3.11.7")))["hollow-package"]
    assert gpu.command.startswith(
        "python -m pip uninstall -y flash-attn && python -m pip cache remove flash_attn && python -m pip install "
    )
    assert "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl" in gpu.command


def test_skip_cuda_build_variable_warns_before_install(monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_SKIP_CUDA_BUILD", "TRUE")
    f = rules_fired(Context(facts=this_machine()))["hollow-package"]
    assert f.severity == "warning" and f.command.startswith("unset FLASH_ATTENTION_SKIP_CUDA_BUILD")


# -- 12 and 13 ---------------------------------------------------------------------------------
# torch SDPA limited to its flash kernel on a T4, as a user's run prints it. Composed from the
# messages in torch's aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (select_sdp_backend
# prints one "... kernel not used because:" warning per kernel, each followed by its reasons, then
# raises); the paths are a Colab install's. There is no T4 on the test machine.
T4_FLASH_ONLY_LOG = """\
/usr/local/lib/python3.11/dist-packages/torch/nn/functional.py:5849: UserWarning: Memory efficient kernel not used because: (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:776.)
  out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
/usr/local/lib/python3.11/dist-packages/torch/nn/functional.py:5849: UserWarning: Memory Efficient attention has been runtime disabled. (Triggered internally at /pytorch/aten/src/ATen/native/transformers/sdp_utils_cpp.h:551.)
/usr/local/lib/python3.11/dist-packages/torch/nn/functional.py:5849: UserWarning: Flash attention kernel not used because: (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:778.)
/usr/local/lib/python3.11/dist-packages/torch/nn/functional.py:5849: UserWarning: Flash attention only supports gpu architectures in the range [sm80, sm90]. Attempting to run on a sm 7.5 gpu. (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:213.)
/usr/local/lib/python3.11/dist-packages/torch/nn/functional.py:5849: UserWarning: cuDNN attention kernel not used because: (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:780.)
Traceback (most recent call last):
  File "/content/train.py", line 14, in <module>
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
RuntimeError: No available kernel. Aborting execution.
"""

T4 = {
    "devices": [{"name": "Tesla T4", "capability": [7, 5], "shared_memory_per_block": 65536}],
    "driver": "550.54.15",
    "driver_cuda": "12.4",
    "source": "torch",
}


def turing_explain(monkeypatch) -> dict:
    """flash_recipe.explain for a float16 call on a T4, as probe_backends records it: the
    capability is mocked and the CUDA tensors are FakeTensors (no GPU here)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flash_recipe
    from flash_recipe import dispatch

    monkeypatch.setattr(dispatch.capabilities, "capability", lambda index: (7, 5))
    monkeypatch.setattr(torch.version, "hip", None)
    with FakeTensorMode():
        q = torch.empty(1, 16, 2, 64, dtype=torch.float16, device="cuda")
    return {
        "call": "q, k, v of shape (1, 16, 2, 64), float16, on cuda, causal=True",
        "explain": flash_recipe.explain(q, q, q, causal=True),
    }


def turing_sdpa_probe() -> dict:
    """What probe_sdpa records on a T4 (injected: torch's own messages, no GPU here)."""
    return {
        "device": {"name": "Tesla T4", "capability": [7, 5]},
        "kernels": {
            "FLASH_ATTENTION": {
                "ok": False,
                "error": "RuntimeError: No available kernel. Aborting execution.",
                "warnings": [
                    "Memory efficient kernel not used because:",
                    "Memory Efficient attention has been runtime disabled.",
                    "Flash attention kernel not used because:",
                    "Flash attention only supports gpu architectures in the range [sm80, sm90]. Attempting to run on a sm 7.5 gpu.",
                ],
            },
            "EFFICIENT_ATTENTION": {"ok": True, "error": None, "warnings": []},
        },
    }


def test_turing_gpu_is_too_old():
    """Injected: a Tesla T4 (sm75) with flash-attn installed."""
    facts = gpu_facts(gpus=T4)
    f = rules_fired(Context(facts=facts))["gpu-too-old"]
    assert f.severity == "error" and "Tesla T4 is sm75 (Turing)" in f.evidence[0]
    assert f.command.startswith("python -m pip uninstall -y flash-attn")
    assert "sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])" in f.command


def test_turing_finding_says_what_runs_there_and_why(monkeypatch):
    """Injected T4 without flash-attn: flash_recipe runs, so the finding is information, naming the
    backend flash_recipe picks (its real explain() on a mocked sm75) and why nothing faster runs."""
    backends = turing_explain(monkeypatch)
    facts = gpu_facts(gpus=T4, flash_attn={"installed": False}, backends=backends, sdpa=turing_sdpa_probe())
    report = rules_fired(Context(facts=facts))
    f = report["gpu-too-old"]
    assert f.severity == "info" and "sdpa-no-kernel" not in report
    assert "memory-efficient" in f.title
    text = "\n".join(f.evidence)
    assert "with its 'sdpa' backend" in text
    assert f"flash_recipe's triton backend: {backends['explain']['triton']}" in text
    assert "live: sdpa_kernel([SDPBackend.FLASH_ATTENTION]) here raises RuntimeError: No available kernel" in text
    assert "Attempting to run on a sm 7.5 gpu" in text and "EFFICIENT_ATTENTION]) here runs" in text
    for words in (
        "memory-efficient kernel",
        "tl.dot to FMA",
        "no tensor-core path",
        "sm80 or newer",
        "#330, #542, #720, #887",
    ):
        assert words in f.note and words in backends["explain"]["triton"], words
    assert "from flash_recipe import scaled_dot_product_attention" in f.command


def test_turing_issue_list_is_the_dispatchers():
    from flash_recipe import dispatch
    from flash_recipe.env import rules

    assert rules.TURING_ISSUES == dispatch.TURING_ISSUES


def test_healthy_turing_machine_stays_healthy(capsys):
    """Injected T4 facts through the whole doctor: an info finding, exit status 0."""
    import argparse

    from flash_recipe.env import doctor

    facts = gpu_facts(gpus=T4, flash_attn={"installed": False}, sdpa=turing_sdpa_probe(), project={"installer": "pip"})
    args = argparse.Namespace(
        installer=None, log=None, wheel=None, flash_attn_wheel=None, flex=False, online=False, project=None
    )
    report = doctor.diagnose(args, facts=facts)
    assert report["healthy"] is True
    assert [f["rule"] for f in report["findings"]] == ["gpu-too-old"]
    text = doctor.format_report(report)
    assert (
        "[info] gpu-too-old" in text
        and "torch SDPA, one kernel at a time on this GPU: flash fails: RuntimeError: No available kernel" in text
    )


def test_sdpa_flash_only_on_t4_from_log():
    """The log alone (no GPU facts: a CPU machine reading a Colab user's log)."""
    facts = this_machine()
    found = rules_fired(Context(facts=facts, log=T4_FLASH_ONLY_LOG))
    f = found["sdpa-no-kernel"]
    assert f.severity == "error" and f.failure == 12
    assert f.evidence[0] == "log: RuntimeError: No available kernel. Aborting execution."
    reasons = f.evidence[1:]
    assert (
        "log: torch says: Flash attention only supports gpu architectures in the range [sm80, sm90]. Attempting to run on a sm 7.5 gpu."
        in reasons
    )
    assert "log: torch says: Memory Efficient attention has been runtime disabled." in reasons
    assert not any("not used because" in line or "Triggered internally" in line for line in reasons)
    assert "the sm75 GPU the log names" in f.title and "flash kernel" in f.title
    assert "sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])" in f.command
    assert "from flash_recipe import scaled_dot_product_attention" in f.command
    assert "memory-efficient" in f.note and "#330, #542, #720, #887" in f.note


def test_sdpa_flash_only_log_read_on_the_t4_itself_names_the_gpu():
    """doctor --log on the T4 machine (injected live GPU facts): the finding names the GPU."""
    facts = gpu_facts(gpus=T4, flash_attn={"installed": False}, sdpa=turing_sdpa_probe())
    f = rules_fired(Context(facts=facts, log=T4_FLASH_ONLY_LOG))["sdpa-no-kernel"]
    assert "Tesla T4 (sm75)" in f.title
    assert "this machine's GPU: Tesla T4 is sm75 (Turing)" in f.evidence


def test_sdpa_no_kernel_with_one_space_and_no_gpu_in_the_log():
    """A pasted error without torch's warnings, on an sm80+ machine: the general finding."""
    log = "RuntimeError: No available kernel. Aborting execution.\n"
    f = rules_fired(Context(facts=gpu_facts(), log=log))["sdpa-no-kernel"]
    assert f.severity == "error" and "no kernel it was allowed to use" in f.title
    assert "kernel not used because" in f.note and "EFFICIENT_ATTENTION" in f.command


def test_sdpa_no_kernel_live_on_an_sm90_torch_without_flash():
    """Injected: the live probe on an H100 whose torch has no flash kernel compiled in."""
    probe = {
        "device": {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]},
        "kernels": {
            "FLASH_ATTENTION": {
                "ok": False,
                "error": "RuntimeError: No available kernel. Aborting execution.",
                "warnings": [
                    "Flash attention kernel not used because:",
                    "Torch was not compiled with flash attention.",
                ],
            },
            "EFFICIENT_ATTENTION": {"ok": True, "error": None, "warnings": []},
        },
    }
    f = rules_fired(Context(facts=gpu_facts(sdpa=probe)))["sdpa-no-kernel"]
    assert f.severity == "warning"
    assert "live: torch says: Torch was not compiled with flash attention." in f.evidence


def test_sdpa_probe_quiet_when_flash_runs():
    probe = {
        "device": {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]},
        "kernels": {
            "FLASH_ATTENTION": {"ok": True, "error": None, "warnings": []},
            "EFFICIENT_ATTENTION": {"ok": True, "error": None, "warnings": []},
        },
    }
    assert evaluate(Context(facts=gpu_facts(sdpa=probe), installer="pip", flash_attn_version="2.8.3")) == []


def test_fp32_inputs_from_log():
    log = "RuntimeError: FlashAttention only support fp16 and bf16 data type\n"
    f = rules_fired(Context(facts=gpu_facts(), log=log))["fp32-inputs"]
    assert "bfloat16" in f.command


# -- Triton below the supported range (bounds read from flash_recipe.env.versions) --------------
def _dotted(release) -> str:
    return ".".join(str(x) for x in release)


def old_stack(**overrides) -> dict:
    """Injected: CUDA 12.1 torch 2.4 (pins Triton 3.0) on a GPU machine; no GPU here."""
    facts = gpu_facts(
        torch__version="2.4.1+cu121",
        torch__cuda="12.1",
        torch__installer="pip",
        triton={"installed": True, "version": "3.0.0", "target": "cuda:90"},
        flash_attn={"installed": False},
    )
    facts.update(overrides)
    return facts


def test_triton_too_old_upgrades_torch_with_pip():
    from flash_recipe.env import versions

    f = rules_fired(Context(facts=old_stack(), installer="pip"))["triton-too-old"]
    torch_min, triton_min = _dotted(versions.TORCH_MIN), _dotted(versions.TRITON_MIN)
    assert f.severity == "error" and f.recipe == "torch-index-pip"
    assert (
        f.command
        == f'python -m pip install --upgrade "torch>={torch_min}" --index-url https://download.pytorch.org/whl/cu121'
    )
    assert f"Triton 3.0.0 is installed; flash_recipe's kernels need Triton {triton_min} or newer" == f.evidence[0]
    assert "torch 2.4.1+cu121 pins Triton 3.0: Triton comes with torch" in f.evidence[1]
    assert "not Triton alone" in f.note and "CUDA 12.8" in f.note  # the driver's CUDA bounds the index to take


@pytest.mark.parametrize(
    "installer, project, expected",
    [
        (
            "uv",
            {
                "pyproject": True,
                "torch_index": {
                    "name": "pytorch-cu121",
                    "url": "https://download.pytorch.org/whl/cu121",
                    "pinned": True,
                },
            },
            "uv add \"torch>={torch_min}\"   # [tool.uv.sources] keeps torch on the index 'pytorch-cu121'",
        ),
        (
            "uv",
            {"pyproject": True},
            'uv add "torch>={torch_min}" --index pytorch=https://download.pytorch.org/whl/cu121',
        ),
        (
            "uv",
            {"pyproject": False},
            'uv pip install --upgrade "torch>={torch_min}" --index-url https://download.pytorch.org/whl/cu121',
        ),
        (
            "poetry",
            {
                "pyproject": True,
                "torch_index": {"name": "torch-cu121", "url": "https://download.pytorch.org/whl/cu121", "pinned": True},
            },
            'poetry add --source torch-cu121 "torch>={torch_min}"',
        ),
        (
            "poetry",
            {"pyproject": True},
            'poetry source add --priority=explicit pytorch https://download.pytorch.org/whl/cu121 && poetry add --source pytorch "torch>={torch_min}"',
        ),
        (
            "pip",
            {"torch_index": {"name": "mirror", "url": "https://mirror.example/whl/cu121", "pinned": False}},
            'python -m pip install --upgrade "torch>={torch_min}" --index-url https://mirror.example/whl/cu121',
        ),
    ],
    ids=["uv-pinned-index", "uv-project", "uv-pip", "poetry-source", "poetry-new-source", "pip-project-index"],
)
def test_triton_too_old_command_per_installer(installer, project, expected):
    from flash_recipe.env import versions

    f = rules_fired(Context(facts=old_stack(), installer=installer, project=project))["triton-too-old"]
    assert f.command == expected.format(torch_min=_dotted(versions.TORCH_MIN))


def test_triton_too_old_under_conda_torch():
    """Injected: torch installed by conda (its dist-info INSTALLER says conda)."""
    from flash_recipe.env import versions

    f = rules_fired(Context(facts=old_stack(torch=dict(old_stack()["torch"], installer="conda")), installer="pip"))[
        "triton-too-old"
    ]
    assert f.command.startswith(f'conda install -c conda-forge "pytorch>={_dotted(versions.TORCH_MIN)}"')


def test_triton_changed_under_a_recent_torch_gets_torchs_pin():
    """Injected: torch at the supported minimum, but an older Triton installed over its pin."""
    from flash_recipe.env import versions

    torch_min = versions.TORCH_MIN
    pinned = versions.TRITON_OF_TORCH.get(torch_min)
    facts = old_stack(torch=dict(gpu_facts()["torch"], version=f"{_dotted(torch_min)}.0+cu124", cuda="12.4"))
    f = rules_fired(Context(facts=facts, installer="pip"))["triton-too-old"]
    assert "Triton was changed after torch was installed" in f.evidence[1]
    spec = f"triton=={_dotted(pinned)}.*" if pinned else f"triton>={_dotted(versions.TRITON_MIN)}"
    assert f.command == f'python -m pip install --upgrade "{spec}"'


def test_triton_too_old_under_cpu_torch_upgrades_triton_alone():
    """This machine's real probes (CPU torch), with an injected old Triton."""
    from flash_recipe.env import versions

    facts = this_machine(triton={"installed": True, "version": "3.0.0", "target": None})
    f = rules_fired(Context(facts=facts, installer="pip"))["triton-too-old"]
    assert f.severity == "warning" and "does not pin Triton" in f.evidence[1]
    assert f.command == f'python -m pip install --upgrade "triton>={_dotted(versions.TRITON_MIN)}"'


def test_triton_bounds_are_read_from_versions_at_run_time(monkeypatch):
    """Another release of the bounds: the finding follows flash_recipe.env.versions, not a copy."""
    from flash_recipe.env import versions

    monkeypatch.setattr(versions, "TRITON_MIN", (3, 5))
    monkeypatch.setattr(versions, "TORCH_MIN", (2, 9))
    facts = old_stack(
        triton={"installed": True, "version": "3.4.0", "target": "cuda:90"},
        torch=dict(gpu_facts()["torch"], version="2.8.0+cu128", installer="pip"),
    )
    f = rules_fired(Context(facts=facts, installer="pip"))["triton-too-old"]
    assert "need Triton 3.5 or newer" in f.evidence[0] and '"torch>=2.9"' in f.command
    monkeypatch.setattr(versions, "TRITON_MIN", (3, 4))
    assert "triton-too-old" not in rules_fired(Context(facts=facts, installer="pip"))


def test_supported_triton_is_quiet():
    from flash_recipe.env import versions

    facts = gpu_facts(
        triton={"installed": True, "version": f"{_dotted(versions.TRITON_MIN)}.0+git35c6c7c6", "target": "cuda:90"}
    )
    assert "triton-too-old" not in rules_fired(Context(facts=facts))


# -- the causes behind them --------------------------------------------------------------------
def test_torch_missing():
    """Injected (a real no-torch venv is exercised in test_doctor_cli)."""
    facts = this_machine(torch={"installed": False, "version": None})
    f = rules_fired(Context(facts=facts, installer="uv"))["torch-missing"]
    assert f.recipe == "torch-index-uv" and "download.pytorch.org/whl/cpu" in f.command


def test_cpu_torch_on_a_gpu_machine():
    """Injected: an NVIDIA driver is present but torch is the CPU build."""
    facts = gpu_facts(torch__cuda=None, torch__build="cpu", torch__version="2.8.0+cpu")
    f = rules_fired(Context(facts=facts, installer="poetry"))["cpu-torch-with-gpu"]
    assert f.recipe == "torch-index-poetry" and "poetry source add --priority=explicit pytorch" in f.command


def test_cpu_torch_here_cannot_run_flash_attn():
    """This machine for real: asking for flash-attn with a CPU torch and no GPU."""
    f = rules_fired(Context(facts=this_machine(), flash_attn_version="2.8.3"))["cpu-torch-flash-attn"]
    assert f.severity == "warning" and "flash-recipe" in f.command
    log_f = rules_fired(Context(facts=this_machine(), log=CPU_TORCH_LOG))["cpu-torch-flash-attn"]
    assert log_f.severity == "error"


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_switch_other_than_TRUE_is_ignored_upstream(monkeypatch, value):
    monkeypatch.setenv("FLASH_ATTENTION_FORCE_BUILD", value)
    f = rules_fired(Context(facts=this_machine()))["env-switch-not-true"]
    assert f.command == "export FLASH_ATTENTION_FORCE_BUILD=TRUE"


def test_switch_TRUE_is_not_flagged(monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_FORCE_BUILD", "TRUE")
    assert "env-switch-not-true" not in rules_fired(Context(facts=this_machine()))


def test_no_backend():
    facts = gpu_facts(backends={"explain": {"triton": "no GPU", "sdpa": "torch too old", "reference": "broken"}})
    assert rules_fired(Context(facts=facts))["no-backend"].severity == "error"


# -- the rule set as a whole -------------------------------------------------------------------
def test_a_broken_rule_does_not_hide_the_others(monkeypatch):
    from flash_recipe.env import findings

    def explode(ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(findings, "RULES", [("explodes", explode)] + list(RULES))
    found = rules_fired(Context(facts=gpu_facts(), log=ISOLATED_BUILD_LOG))
    assert found["explodes"].severity == "info" and "boom" in found["explodes"].evidence[0]
    assert "build-isolation-no-torch" in found


def test_every_known_failure_has_a_rule():
    import inspect

    from flash_recipe.env import rules as rules_module

    source = "".join(inspect.getsource(module) for module in rules_module.RULE_MODULES)
    numbers = {int(n) for n in __import__("re").findall(r"failure=(\d+)", source)}
    assert numbers == set(range(1, 14))


def test_findings_sort_errors_first():
    log = ISOLATED_BUILD_LOG + "FLASH_ATTENTION_FORCE_BUILD\n"
    facts = gpu_facts(env={"FLASH_ATTENTION_FORCE_BUILD": "1"})
    severities = [f.severity for f in evaluate(Context(facts=facts, log=log))]
    assert severities == sorted(severities, key=["error", "warning", "info"].index) and len(severities) >= 2


def test_finding_rejects_unknown_severity():
    with pytest.raises(ValueError, match="severity"):
        Finding("x", "t", "fatal", [], "upstream-flash-attn", "")


def test_cited_recipes_exist_as_folders():
    root = Path(__file__).resolve().parents[1] / "recipes"
    missing = sorted(name for name in cited_recipes() if not (root / name).is_dir())
    assert missing == [], f"recipes cited by the doctor but absent from recipes/: {missing}"


def test_every_recipe_a_finding_cites_is_in_cited_recipes(tmp_path):
    """Run the rules over a spread of situations; each recipe named must be a known one."""
    contexts = (
        [
            Context(facts=gpu_facts(), log=ISOLATED_BUILD_LOG + NO_CUDA_HOME_LOG + CPU_TORCH_LOG, installer=i)
            for i in ("pip", "uv", "poetry")
        ]
        + [
            Context(
                facts=gpu_facts(
                    torch__version="2.9.1+cu128",
                    flash_attn={"installed": False},
                    gpus={"devices": [{"name": "T4", "capability": [7, 5]}]},
                ),
                flash_attn_version="2.8.3",
                installer=i,
            )
            for i in ("pip", "uv", "poetry")
        ]
        + [Context(facts=this_machine(torch={"installed": False}), installer=i) for i in ("pip", "uv", "poetry")]
    )
    recipes = {f.recipe for ctx in contexts for f in evaluate(copy.deepcopy(ctx))}
    assert recipes and recipes <= cited_recipes()


def test_guessed_263_wheel_name_in_log_is_resolved_with_its_own_cuda_label():
    """2.6.3 names carry cu123: a published one that fell back means a blocked download."""
    url = "https://github.com/Dao-AILab/flash-attention/releases/download/v2.6.3/flash_attn-2.6.3+cu123torch2.4cxx11abiFALSE-cp310-cp310-linux_x86_64.whl"
    log = f"Guessing wheel URL:  {url}\nPrecompiled wheel not found. Building from source...\n"
    found = rules_fired(Context(facts=gpu_facts(), log=log))
    assert "wheel-download-blocked" in found and "no-prebuilt-wheel" not in found


# -- transformers and kernels ---------------------------------------------------------------------


def _fake_distributions(tmp_path: Path, monkeypatch, **versions) -> None:
    """dist-info metadata of each ``name=version`` on a tmp sys.path entry, found before any real one."""
    site = tmp_path / "site"
    for name, version in versions.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(site))


@pytest.mark.parametrize(
    "transformers, kernels, fires",
    [
        ("5.22.2", "0.18.3", "kernels>=0.17.2,<0.18.0"),
        ("5.20.2", "0.17.1", "kernels>=0.17.2,<0.18.0"),
        ("5.23.0", "0.17.2", "kernels>=0.18.2,<0.19.0"),
        ("5.18.0", "0.17.0", None),
        ("5.22.2", "0.17.2", None),
        ("5.24.0", "0.18.2", None),
        ("4.57.1", "0.18.3", None),  # below the table: transformers loads no Hub kernel this way
    ],
)
def test_transformers_kernels_pair_from_installed_metadata(tmp_path, monkeypatch, transformers, kernels, fires):
    """The real probe reads the two distributions' metadata (fake dist-infos on sys.path)."""
    _fake_distributions(tmp_path, monkeypatch, transformers=transformers, kernels=kernels)
    facts = {"libraries": probes.probe_libraries()}
    assert facts["libraries"] == {"transformers": transformers, "kernels": kernels}
    found = rules_fired(Context(facts=facts)).get("transformers-kernels-pair")
    if fires is None:
        assert found is None
        return
    assert found.severity == "error" and found.recipe == ""
    assert found.command == f'python -m pip install --upgrade "{fires}"'
    assert f"kernels {kernels} is installed" in found.evidence[0]


def test_transformers_kernels_pair_quiet_without_kernels(tmp_path, monkeypatch):
    _fake_distributions(tmp_path, monkeypatch, transformers="5.22.2")
    facts = {"libraries": {"transformers": "5.22.2", "kernels": None}}
    assert "transformers-kernels-pair" not in rules_fired(Context(facts=facts))


@pytest.mark.parametrize(
    "installer, project, command",
    [
        ("uv", {"pyproject": "/p/pyproject.toml"}, 'uv add "kernels>=0.17.2,<0.18.0"'),
        ("poetry", {"pyproject": "/p/pyproject.toml"}, 'poetry add "kernels>=0.17.2,<0.18.0"'),
    ],
)
def test_transformers_kernels_pair_command_per_installer(installer, project, command):
    facts = {"libraries": {"transformers": "5.21.0", "kernels": "0.18.2"}}
    found = rules_fired(Context(facts=facts, installer=installer, project=project))["transformers-kernels-pair"]
    assert found.command == command
