"""Upstream flash-attn wheel naming: real published asset names, the release tables, the resolver."""

from __future__ import annotations

import zipfile

import pytest

from flash_recipe.env.published import LATEST, RELEASES
from flash_recipe.env.wheels import (
    cuda_label,
    inspect_wheel_file,
    parse_wheel_filename,
    published_filenames,
    resolve,
    wheel_filename,
    wheel_url,
)

# Asset names as they appear in download URLs of upstream's GitHub releases, quoted verbatim in
# public install scripts and issues (flash-attention #1234 for the 2.6.3 cxx11abiTRUE one).
REAL_ASSETS = [
    ("flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl", "3.12", "2.8.0+cu128", True, "12.8"),
    ("flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl", "3.11", "2.8.0+cu126", True, "12.6"),
    ("flash_attn-2.8.3+cu12torch2.8cxx11abiFALSE-cp310-cp310-linux_x86_64.whl", "3.10", "2.8.0", False, "12.8"),
    ("flash_attn-2.8.3+cu12torch2.5cxx11abiFALSE-cp312-cp312-linux_x86_64.whl", "3.12", "2.5.1+cu124", False, "12.4"),
    (
        "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp312-cp312-linux_x86_64.whl",
        "3.12",
        "2.6.0+cu124",
        False,
        "12.4",
    ),
    ("flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp311-cp311-linux_x86_64.whl", "3.11", "2.6.0", False, "12.4"),
    ("flash_attn-2.7.4.post1+cu12torch2.6cxx11abiTRUE-cp312-cp312-linux_x86_64.whl", "3.12", "2.6.0", True, "12.6"),
    (
        "flash_attn-2.7.4.post1+cu12torch2.5cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
        "3.10",
        "2.5.1+cu121",
        False,
        "12.1",
    ),
    ("flash_attn-2.7.4.post1+cu12torch2.4cxx11abiFALSE-cp39-cp39-linux_x86_64.whl", "3.9", "2.4.1", False, "12.1"),
    (
        "flash_attn-2.7.4.post1+cu12torch2.2cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
        "3.10",
        "2.2.2+cu121",
        False,
        "12.1",
    ),
    ("flash_attn-2.6.3+cu123torch2.4cxx11abiFALSE-cp310-cp310-linux_x86_64.whl", "3.10", "2.4.0+cu124", False, "12.4"),
    ("flash_attn-2.6.3+cu123torch2.4cxx11abiTRUE-cp311-cp311-linux_x86_64.whl", "3.11", "2.4.1", True, "12.4"),
    ("flash_attn-2.6.3+cu123torch2.1cxx11abiFALSE-cp310-cp310-linux_x86_64.whl", "3.10", "2.1.2+cu121", False, "12.1"),
    ("flash_attn-2.6.3+cu118torch2.4cxx11abiFALSE-cp310-cp310-linux_x86_64.whl", "3.10", "2.4.0+cu118", False, "11.8"),
]


def _id(case):
    return case[0].split("+", 1)[1].replace(".whl", "")


@pytest.mark.parametrize("case", REAL_ASSETS, ids=[_id(c) for c in REAL_ASSETS])
def test_resolver_reproduces_real_asset_name(case):
    name, python, torch, abi, cuda = case
    version = name.split("-")[1].split("+")[0]
    assert wheel_filename(version, python=python, torch=torch, cxx11abi=abi, cuda=cuda) == name
    res = resolve(version, python=python + ".4", torch=torch, cxx11abi=abi, cuda=cuda)
    assert res["filename"] == name
    assert res["url"] == f"https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/{name}"
    assert res["status"] == "published"


@pytest.mark.parametrize("case", REAL_ASSETS, ids=[_id(c) for c in REAL_ASSETS])
def test_parse_round_trips(case):
    name = case[0]
    parts = parse_wheel_filename(name)
    rebuilt = wheel_filename(
        parts["version"],
        python=parts["python"],
        torch=parts["torch"],
        cxx11abi=parts["cxx11abi"],
        cuda=case[4],
        platform=parts["platform"],
    )
    assert rebuilt == name


def test_every_recorded_asset_is_a_well_formed_name():
    for version in RELEASES:
        for name in published_filenames(version):
            assert parse_wheel_filename(name)["version"] == version


def test_283_matrix_has_fifty_linux_x86_64_wheels():
    names = published_filenames("2.8.3")
    assert len(names) == 5 * 5 * 2 == len(set(names))
    assert all(n.endswith("-linux_x86_64.whl") and "+cu12torch" in n for n in names)
    assert "flash_attn-2.8.3+cu12torch2.4cxx11abiFALSE-cp39-cp39-linux_x86_64.whl" in names
    assert not any("torch2.9" in n or "cp314" in n for n in names)


def test_cuda_label_changed_at_270():
    assert cuda_label("2.8.3", "12.8") == "cu12"
    assert cuda_label("2.7.0", "11.8") == "cu11"
    assert cuda_label("2.6.3", "12.8") == "cu123"
    assert cuda_label("2.6.3", "11.7") == "cu118"
    with pytest.raises(ValueError, match="2.6.0 or newer"):
        cuda_label("2.5.8", "12.2")


def test_cuda_comes_from_torch_not_nvcc_and_local_label_is_dropped():
    name = wheel_filename("2.8.3", python="3.11", torch="2.7.1+cu126", cxx11abi=True, cuda="12.6")
    assert name == "flash_attn-2.8.3+cu12torch2.7cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"


def test_never_published_combination_names_nearest_and_says_so():
    res = resolve("2.8.3", python="3.12", torch="2.9.1+cu128", cxx11abi=True, cuda="12.8")
    assert res["status"] == "not-published"
    assert res["filename"] == "flash_attn-2.8.3+cu12torch2.9cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    assert "never published" in res["reason"]
    assert res["nearest"]["filename"] == "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    assert res["nearest"]["differs"] == ["torch 2.8 instead of 2.9"]


def test_python_314_and_aarch64_were_never_published():
    res = resolve("2.8.3", python="3.14", torch="2.8.0", cxx11abi=True, cuda="12.8")
    assert res["status"] == "not-published"
    assert res["nearest"]["python"] == "3.13"
    arm = resolve("2.8.3", python="3.12", torch="2.8.0", cxx11abi=True, cuda="12.8", platform="linux_aarch64")
    assert arm["status"] == "not-published"
    assert arm["nearest"]["platform"] == "linux_x86_64"


def test_partial_release_table_does_not_claim_never_published():
    res = resolve("2.7.4.post1", python="3.13", torch="2.6.0", cxx11abi=True, cuda="12.4")
    assert res["status"] == "not-confirmed"
    assert "not recorded" in res["reason"]


def test_cpu_torch_and_missing_torch_cannot_be_named():
    cpu = resolve(None, python="3.11", torch="2.13.0+cpu", cxx11abi=True)
    assert cpu["version"] == LATEST and cpu["filename"] is None and cpu["status"] == "no-gpu-torch"
    assert cpu["nearest"] is not None
    none = resolve(None, python="3.11", torch=None, cxx11abi=None)
    assert none["status"] == "no-torch" and none["nearest"] is None


def test_rocm_torch_is_named_but_never_published():
    res = resolve("2.8.3", python="3.12", torch="2.8.0+rocm6.3", cxx11abi=True, hip="6.3.42131")
    assert res["filename"] == "flash_attn-2.8.3+rocm63torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    assert res["status"] == "not-published"


def test_unknown_release_is_said_plainly():
    res = resolve("2.8.2", python="3.12", torch="2.8.0", cxx11abi=True, cuda="12.8")
    assert res["status"] == "unknown-release"


def test_bad_inputs_raise_with_names():
    with pytest.raises(ValueError, match="flash-attn version"):
        resolve("latest", python="3.12", torch="2.8.0", cxx11abi=True, cuda="12.8")
    with pytest.raises(TypeError, match="cxx11abi"):
        wheel_filename("2.8.3", python="3.12", torch="2.8", cxx11abi="TRUE", cuda="12.8")
    with pytest.raises(ValueError, match="exactly one of cuda or hip"):
        wheel_filename("2.8.3", python="3.12", torch="2.8", cxx11abi=True)
    with pytest.raises(ValueError, match="filename must look like"):
        parse_wheel_filename("flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl")
    with pytest.raises(TypeError, match="filename"):
        parse_wheel_filename(None)


def test_url_encoded_plus_is_accepted():
    parts = parse_wheel_filename(
        "https://github.com/x/y/releases/download/v2.8.3/flash_attn-2.8.3%2Bcu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    )
    assert parts["torch"] == "2.8" and parts["cxx11abi"] is True
    assert wheel_url("2.8.3", "a.whl").endswith("/v2.8.3/a.whl")


def _write_wheel(path, metadata_version, tag="cp312-cp312-linux_x86_64"):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            "flash_attn-2.8.3.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: flash_attn\nVersion: {metadata_version}\n",
        )
        archive.writestr(
            "flash_attn-2.8.3.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n"
        )


def test_inspect_wheel_file_reads_name_and_metadata(tmp_path):
    path = tmp_path / "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    _write_wheel(path, "2.8.3")
    info = inspect_wheel_file(str(path))
    assert info["name_version"] == "2.8.3+cu12torch2.8cxx11abiTRUE"
    assert info["metadata_version"] == "2.8.3"
    assert info["tags"] == ["cp312-cp312-linux_x86_64"]
    assert info["name_parts"]["torch"] == "2.8"


def test_inspect_wheel_file_rejects_non_wheels(tmp_path):
    bad = tmp_path / "flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl"
    bad.write_text("not a zip")
    with pytest.raises(ValueError, match="readable wheel"):
        inspect_wheel_file(str(bad))
    with pytest.raises(ValueError, match=r"\.whl"):
        inspect_wheel_file(str(tmp_path / "x.tar.gz"))
