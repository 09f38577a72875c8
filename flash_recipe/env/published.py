"""Which prebuilt wheels each upstream flash-attn release published, kept as data.

Upstream (github.com/Dao-AILab/flash-attention) attaches its prebuilt wheels to each GitHub
release; PyPI carries only the source distribution. A release's wheels are the product of the
build matrix in its ``.github/workflows/publish.yml``: every Python x torch x CUDA x C++ ABI
combination listed there, for ``linux_x86_64`` only.

``RELEASES`` holds, per release, either

- ``"matrix"``: the complete published matrix (axes whose product is the set of assets), so the
  resolver can say both "published" and "never published"; or
- ``"assets"``: only asset file names seen verbatim in public sources. These prove that a
  combination exists but say nothing about the ones not listed, so the resolver answers
  "not confirmed" for those instead of guessing.

Sources:

- 2.8.3: the release's build matrix (Python 3.9-3.13 x torch 2.4-2.8 x CUDA 12 x both C++ ABIs,
  linux_x86_64); torch 2.9 was never added to this release (flash-attention issue #1967, "Prebuilt
  wheels for PyTorch 2.9 on the 2.8.3 release", still open), and later torch versions are only
  offered by third-party rebuilds (issues #2248, #2299, #2425).
- 2.7.4.post1 and 2.6.3: asset names quoted in public install scripts, READMEs and Dockerfiles
  that download them from the release URL, and in flash-attention issue #1234 (2.6.3, cu123,
  torch 2.4, C++11 ABI TRUE).
"""

from __future__ import annotations

RELEASES: dict[str, dict] = {
    "2.8.3": {
        "matrix": {
            "python": ["3.9", "3.10", "3.11", "3.12", "3.13"],
            "torch": ["2.4", "2.5", "2.6", "2.7", "2.8"],
            "cuda": ["12"],
            "cxx11abi": [False, True],
            "platform": ["linux_x86_64"],
        },
    },
    "2.7.4.post1": {
        "assets": [
            "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp312-cp312-linux_x86_64.whl",
            "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp311-cp311-linux_x86_64.whl",
            "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
            "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiTRUE-cp312-cp312-linux_x86_64.whl",
            "flash_attn-2.7.4.post1+cu12torch2.5cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
            "flash_attn-2.7.4.post1+cu12torch2.4cxx11abiFALSE-cp39-cp39-linux_x86_64.whl",
            "flash_attn-2.7.4.post1+cu12torch2.2cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
        ],
    },
    "2.6.3": {
        "assets": [
            "flash_attn-2.6.3+cu123torch2.4cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
            "flash_attn-2.6.3+cu123torch2.4cxx11abiFALSE-cp311-cp311-linux_x86_64.whl",
            "flash_attn-2.6.3+cu123torch2.4cxx11abiTRUE-cp311-cp311-linux_x86_64.whl",
            "flash_attn-2.6.3+cu123torch2.3cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
            "flash_attn-2.6.3+cu123torch2.1cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
            "flash_attn-2.6.3+cu118torch2.4cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
        ],
    },
}

# The release the doctor recommends when none is named.
LATEST = "2.8.3"
