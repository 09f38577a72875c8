"""flash_recipe as a Hugging Face Hub kernel (``flash-recipe hub-build``, docs/hub-kernel.md).

The build (every environment): each variant holds the package flat with ``_ops.py``, ``_hub.py``
and ``metadata.json``, without the tools, the doctor or bytecode, and with no import of the package
by its own name; the id's uid follows the git tree, ``_dirty`` included.

Loading (``nox -s hub_kernel``: ``kernels`` 0.17.2 and a transformers of its window;
``FLASH_RECIPE_REQUIRE_HUB=1``; elsewhere skipped), all offline (``HF_HUB_OFFLINE=1``):

- ``kernels info`` reads the metadata, and ``get_local_kernel`` loads the variant in a process
  where ``import flash_recipe`` fails (``sys.modules["flash_recipe"] = None``): its output, lse and
  gradients by the accuracy rule, its own Triton kernel counted;
- the pip package and the Hub copy in one process: each op name resolves to its own copy's module,
  both give the same outputs, ``get_loaded_kernels()`` lists the id;
- a tiny random Llama with ``attn_implementation="flash-recipe/flash-recipe"`` through
  ``LOCAL_KERNELS`` (transformers' own flash-attention forward calling the Hub copy): logits padded
  and unpadded, the gradients of a training step and greedy generation against ``sdpa``.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_recipe
from flash_recipe.ops import attention as pip_attention
from flash_recipe.ops.options import ScoreOptions
from flash_recipe.testing import assert_accurate
from flash_recipe.tools import hub_build

HAS_KERNELS = importlib.util.find_spec("kernels") is not None
if not HAS_KERNELS and os.environ.get("FLASH_RECIPE_REQUIRE_HUB") == "1":
    raise RuntimeError("FLASH_RECIPE_REQUIRE_HUB=1 but the kernels package is not installed")
NEEDS_KERNELS = pytest.mark.skipif(not HAS_KERNELS, reason="kernels runs in its own environment: nox -s hub_kernel")
REPO_ID = "flash-recipe/flash-recipe"
ID = re.compile(r"_flash_recipe_(cuda|rocm|cpu)_[0-9a-f]{7}(_dirty)?")


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory) -> Path:
    """One build of the installed package: ``<repo>/README.md``, ``<repo>/build/torch-*``."""
    repo = tmp_path_factory.mktemp("hub")
    hub_build.build(repo)
    return repo


def _absolute_imports(source: str) -> list[int]:
    """Lines that import flash_recipe by its name (``import flash_recipe...``, ``from flash_recipe...``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(n.split(".")[0] == "flash_recipe" for n in names):
            found.append(node.lineno)
    return found


def test_each_variant_holds_the_package_flat(hub_repo):
    variants = sorted(p.name for p in (hub_repo / "build").iterdir())
    assert variants == ["torch-cpu", "torch-cuda", "torch-rocm"]
    sources = hub_build.package_files()
    for name in variants:
        variant = hub_repo / "build" / name
        meta = json.loads((variant / "metadata.json").read_text())
        backend = name.removeprefix("torch-")
        assert meta == {
            "name": "flash-recipe",
            "id": meta["id"],
            "version": 1,
            "license": "BSD-3-Clause",
            "python-depends": [],
            "backend": {"type": backend},
        }
        assert ID.fullmatch(meta["id"]) and meta["id"].startswith(f"_flash_recipe_{backend}_")
        files = sorted(p.relative_to(variant) for p in variant.rglob("*") if p.is_file())
        assert files == sorted([*sources, Path("_hub.py"), Path("metadata.json")])
        for rel in (Path("__init__.py"), Path("_ops.py"), Path("api.py"), Path("ops") / "attention.py"):
            assert rel in files
        assert not any(rel.parts[0] in ("tools", "integrations") for rel in files)
        assert sorted(rel for rel in files if rel.parts[0] == "env") == [
            Path("env/__init__.py"),
            Path("env/versions.py"),
        ]
        assert not any(rel.suffix == ".pyc" or "__pycache__" in rel.parts for rel in files)
        for rel in files:
            if rel.suffix == ".py":
                assert _absolute_imports((variant / rel).read_text()) == [], rel
    card = (hub_repo / "README.md").read_text()
    assert "license: bsd-3-clause" in card and "get_kernel(" in card and "attn_implementation=" in card


def test_the_absolute_import_check_sees_one():
    assert _absolute_imports("import torch\nfrom . import api\nfrom flash_recipe.ops import tiles\n") == [3]


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_uid_follows_the_source_tree(tmp_path):
    """A checkout: its revision, ``_dirty`` once the package's files change (and only then). No
    checkout, or a copy the checkout does not track: a hash of the files, which changes with them."""
    package = tmp_path / "repo" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    _git(package.parent, "init", "-q")
    _git(package.parent, "add", ".")
    _git(package.parent, "commit", "-qm", "one")
    revision = _git(package.parent, "rev-parse", "--short=7", "HEAD")
    assert hub_build.source_uid(package) == revision
    (package.parent / "NOTES").write_text("outside the package\n")
    assert hub_build.source_uid(package) == revision
    (package / "__init__.py").write_text("x = 2\n")
    assert hub_build.source_uid(package) == revision + "_dirty"
    for plain in (tmp_path / "plain" / "pkg", tmp_path / "repo" / "site-packages" / "pkg"):
        shutil.copytree(package, plain)
        first = hub_build.source_uid(plain)
        assert re.fullmatch(r"[0-9a-f]{7}", first) and first != revision
        (plain / "__init__.py").write_text("x = 3\n")
        assert hub_build.source_uid(plain) != first


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="version must be a positive integer"):
        hub_build.build(tmp_path, version=0)
    with pytest.raises(ValueError, match="backends must be some of cuda, rocm, cpu, got xpu"):
        hub_build.build(tmp_path, backends=("xpu",))


def test_the_command_writes_the_variants(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "flash_recipe", "hub-build", "--out", str(tmp_path), "--backend", "cpu"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert ID.search(result.stdout) and "hf upload" in result.stdout
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == ["torch-cpu"]


# ----------------------------------------------------------------------------------------------
# Loading with kernels.
# ----------------------------------------------------------------------------------------------


def _offline_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}


@NEEDS_KERNELS
def test_kernels_info_reads_the_metadata(hub_repo):
    kernels_cli = Path(sys.executable).with_name("kernels")
    result = subprocess.run(
        [str(kernels_cli), "info", str(hub_repo), "--json"], capture_output=True, text=True, timeout=120,
        env=_offline_env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert (info["name"], info["version"], info["license"]) == ("flash-recipe", 1, "BSD-3-Clause")
    assert info["python_depends"] == [] and info["backends"] == ["cpu", "cuda", "rocm"]


ALONE = """
import importlib
import sys
sys.modules["flash_recipe"] = None  # the pip package cannot be imported in this process
from pathlib import Path
import torch
from kernels import get_local_kernel

hub = get_local_kernel(Path(sys.argv[1]))
exports = {name: getattr(hub, name) for name in hub.__all__}  # every public name loads from the copy
launches = []
kernel = importlib.import_module(hub.__name__ + ".ops.forward").attn_fwd_kernel.fn
run = kernel.run
kernel.run = lambda *a, **kw: launches.append(1) or run(*a, **kw)
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 37, 4, 32, generator=gen).half().requires_grad_() for _ in range(3))
out, lse, _ = hub.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
dout = torch.randn(out.shape, generator=gen).half()
grads = torch.autograd.grad(out, (q, k, v), dout)
hub.install_as_flash_attn()
import flash_attn
torch.save({
    "name": hub.__name__, "version": hub.__version__, "launches": len(launches),
    "tensors": [t.detach() for t in (q, k, v, dout, out, lse, *grads)],
    "ours": sorted(m for m in sys.modules if m.split(".")[0] == "flash_recipe" and sys.modules[m] is not None),
    "flash_attn": flash_attn.flash_attn_func.__module__,
    "exports": sorted(name for name, value in exports.items() if not isinstance(value, str)),
}, sys.argv[2])
"""


def _attention(q, k, v, causal):
    """Plain attention in the tensors' dtype, bottom-right causal: out (B, S, H, D), lse (B, H, S)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not(), float("-inf"))
    lse = s.logsumexp(-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v), lse


@NEEDS_KERNELS
def test_the_variant_loads_without_the_pip_package(hub_repo, tmp_path):
    """``get_local_kernel`` offline, ``flash_recipe`` unimportable: the Hub copy's forward, lse and
    gradients by the accuracy rule, its own kernel launched; its ``install_as_flash_attn()`` serves
    ``import flash_attn`` from the copy."""
    result_path = tmp_path / "result.pt"
    result = subprocess.run(
        [sys.executable, "-c", ALONE, str(hub_repo), str(result_path)], capture_output=True, text=True,
        timeout=600, env=_offline_env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = torch.load(result_path)
    assert ID.fullmatch(found["name"]) and found["name"].startswith("_flash_recipe_cpu_")
    assert found["version"] == flash_recipe.__version__  # from _hub.py: no distribution metadata is read
    assert found["launches"] >= 1 and found["ours"] == []
    assert found["flash_attn"].startswith(found["name"] + ".")
    assert found["exports"] == sorted(set(flash_recipe.__all__) - {"__version__"})
    q, k, v, dout, out, lse, *grads = found["tensors"]
    high = [t.double().requires_grad_() for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    truth, truth_lse = _attention(*high, causal=True)
    base, base_lse = _attention(*same, causal=True)
    assert_accurate("out", out, truth, base, 2)
    assert_accurate("lse", lse, truth_lse, base_lse.float(), 2)
    truth_grads = torch.autograd.grad(truth, high, dout.double())
    base_grads = torch.autograd.grad(base, same, dout)
    for name, got, want, plain in zip("qkv", grads, truth_grads, base_grads):
        assert_accurate(f"d{name}", got, want, plain, 3)


def _count_launches(monkeypatch, package: str) -> list:
    """Launches of ``package``'s forward kernel from now on (one entry each)."""
    launches: list = []
    kernel = importlib.import_module(package + ".ops.forward").attn_fwd_kernel.fn
    monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **kw: launches.append(1) or _run(*a, **kw))
    return launches


def _hub_copy(hub_repo: Path):
    from kernels import get_local_kernel  # the hub_kernel session's environment only

    return get_local_kernel(hub_repo)


@NEEDS_KERNELS
def test_the_pip_package_and_the_hub_copy_in_one_process(hub_repo, monkeypatch):
    """Each copy's ops under its own namespace, each resolving to its own module and kernel; equal
    outputs; the id among the loaded kernels."""
    from kernels import get_loaded_kernels  # the hub_kernel session's environment only
    from torch._library.custom_ops import OPDEFS

    q, k, v = (torch.randn(1, 45, 2, 32, generator=torch.Generator().manual_seed(i)).half() for i in range(3))
    pip_out = flash_recipe.flash_attn_func(q, k, v, causal=True)
    hub = _hub_copy(hub_repo)
    name = hub.__name__
    assert name in [loaded.metadata.id for loaded in get_loaded_kernels()]
    assert torch.equal(hub.flash_attn_func(q, k, v, causal=True), pip_out)
    importlib.import_module(name + ".ops.attention")  # registers the ops (the eager call needs none)
    for op in ("attn_fwd", "attn_bwd"):
        assert OPDEFS[f"flash_recipe::{op}"]._init_fn.__module__ == "flash_recipe.ops.attention"
        assert OPDEFS[f"{name}::{op}"]._init_fn.__module__ == f"{name}.ops.attention"
    options = ScoreOptions(softmax_scale=32**-0.5, diag_offset=0, window_left=-1, window_right=0, softcap=0.0,
                           alibi_slopes=None)  # fmt: skip
    flat = pip_attention.flatten(options, None)
    pip_launches, hub_launches = _count_launches(monkeypatch, "flash_recipe"), _count_launches(monkeypatch, name)
    pip_op = torch.ops.flash_recipe.attn_fwd(q, k, v, *flat, False)
    assert (len(pip_launches), len(hub_launches)) == (1, 0)
    hub_op = getattr(torch.ops, name).attn_fwd(q, k, v, *flat, False)
    assert (len(pip_launches), len(hub_launches)) == (1, 1)
    assert torch.equal(pip_op[0], pip_out) and torch.equal(hub_op[0], pip_out) and torch.equal(hub_op[1], pip_op[1])


def _llamas(hub_repo: Path, monkeypatch):
    """``(Hub kernel fp32, sdpa fp32, sdpa fp64)`` copies of one tiny random Llama, the first through
    ``LOCAL_KERNELS``, and the Hub copy's module name."""
    transformers = pytest.importorskip("transformers")
    import test_transformers as tiny  # its tiny model configs and inputs

    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO_ID}={hub_repo}")
    config, _ = tiny._config("llama")
    models, weights = [], None
    for impl, dtype in ((REPO_ID, torch.float32), ("sdpa", torch.float32), ("sdpa", torch.float64)):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        weights = weights or {n: t.clone() for n, t in model.state_dict().items()}
        model.load_state_dict(weights)
        models.append(model.to(dtype=dtype).eval())
    assert models[0].config._attn_implementation == REPO_ID
    return models, _hub_copy(hub_repo).__name__, tiny


@NEEDS_KERNELS
@pytest.mark.parametrize("padding", ["none", "left"])
def test_a_tiny_llama_runs_from_the_local_kernel(hub_repo, padding, monkeypatch):
    """Logits of every real token against sdpa by the accuracy rule (left padding: transformers
    unpads and calls ``flash_attn_varlen_func``; none: ``flash_attn_func``), the Hub copy's kernel
    launched, and the pip package's not."""
    (ours, same, truth), name, tiny = _llamas(hub_repo, monkeypatch)
    ids, mask = tiny._inputs(padding, torch.device("cpu"))
    hub_launches, pip_launches = _count_launches(monkeypatch, name), _count_launches(monkeypatch, "flash_recipe")
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = tiny._logits_row_by_row(truth, ids, mask)
        base = tiny._logits_row_by_row(same, ids, mask)
    assert len(hub_launches) >= 2 and not pip_launches  # one launch per layer at least
    keep = mask.bool()
    assert_accurate("logits", got[keep], want[keep], base[keep], 2)


@NEEDS_KERNELS
def test_a_tiny_llamas_gradients_and_generation(hub_repo, monkeypatch):
    """A training step with left padding gives every parameter's gradient by the rule (3x), and greedy
    generation the same tokens as sdpa, each step's logits by the rule."""
    models, name, tiny = _llamas(hub_repo, monkeypatch)
    ids, mask = tiny._inputs("left", torch.device("cpu"))
    labels = ids.masked_fill(mask == 0, -100)
    hub_launches = _count_launches(monkeypatch, name)
    for model in models:
        model.train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        model.eval()
    assert hub_launches
    named = [dict(model.named_parameters()) for model in models]
    for param_name, param in named[0].items():
        assert_accurate(f"grad of {param_name}", param.grad, named[2][param_name].grad.double(),
                        named[1][param_name].grad, 3)  # fmt: skip
    ids, mask = tiny._inputs("left", torch.device("cpu"), seqlen=6)
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=tiny.PAD)  # fmt: skip
    with torch.no_grad():
        got, want, base = (model.generate(ids, **options) for model in models)
    assert torch.equal(base.sequences, want.sequences)  # the test's own premise: no near-ties
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w, b) in enumerate(zip(got.logits, want.logits, base.logits)):
        assert_accurate(f"logits of step {step}", g, w, b, 2)
