"""The shapes of the doctor's facts: one TypedDict per probe in :mod:`flash_recipe.env.probes`.

A probe returns a plain dict (it goes into ``flash-recipe doctor --json`` as it is); these types
name its keys. Keys a probe always sets are required; keys it sets only in some situations (a
probe that stops early, an error it caught) are optional. :class:`Facts` maps each probe's name to
its type. A probe that raised is recorded by :func:`~flash_recipe.env.probes.run_probe` as
:class:`ProbeError` instead, so every entry of :class:`Facts` is either its probe's type or that.

A test (tests/test_doctor_facts.py) reads these declarations: the keys the rules and the report
read must be declared here, and the keys the probes return must be too.
"""

from __future__ import annotations

from typing import Optional, TypedDict, Union


class ProbeError(TypedDict):
    """What :func:`~flash_recipe.env.probes.run_probe` records for a probe that raised."""

    error: str  # "ExceptionType: message", at most 500 characters


class PlatformFacts(TypedDict):
    """:func:`~flash_recipe.env.probes.probe_platform`: this machine and interpreter."""

    os: str  # platform.system(): "Linux", "Windows", "Darwin"
    machine: str  # "x86_64", "aarch64"
    libc: Optional[str]  # "glibc"; None when unknown
    libc_version: Optional[str]
    python: str  # "3.12.7"
    python_tag: str  # "cp312" ("cp313t" for a free-threaded build)
    soabi: Optional[str]
    implementation: str  # "cpython"
    executable: str
    virtualenv: bool
    conda: bool
    wheel_platform: str  # the platform tag a wheel must carry: "linux_x86_64"
    cpu_count: Optional[int]
    mem_available_gib: Optional[float]  # None where /proc/meminfo is unreadable


class _TorchInstalled(TypedDict):
    installed: bool
    version: Optional[str]


class TorchFacts(_TorchInstalled, total=False):
    """:func:`~flash_recipe.env.probes.probe_torch`: ``installed`` and ``version`` always; the rest once
    torch is installed (``import_error`` and nothing after it when it does not import)."""

    installer: Optional[str]  # "pip", "uv", "conda", ...; None when unrecorded
    import_error: str
    cuda: Optional[str]  # torch.version.cuda: "12.8"
    hip: Optional[str]  # torch.version.hip
    cxx11abi: bool  # torch._C._GLIBCXX_USE_CXX11_ABI
    build: str  # "cuda", "rocm" or "cpu"
    cuda_available: bool
    device_count: int
    cuda_error: str  # what torch.cuda raised (then cuda_available is False)


class _GpuDevice(TypedDict):
    name: str
    capability: list[int]  # [major, minor]
    shared_memory_per_block: Optional[int]  # bytes (the opt-in maximum where torch reports it)


class GpuDevice(_GpuDevice, total=False):
    """One GPU of :class:`GpusFacts`; ``total_memory_gib`` only when read through torch."""

    total_memory_gib: float


class _Gpus(TypedDict):
    devices: list[GpuDevice]
    driver: Optional[str]  # "570.86.15"
    driver_cuda: Optional[str]  # the newest CUDA the driver supports: "12.8"
    source: Optional[str]  # "torch" or "nvidia-smi"; None when no GPU was listed


class GpusFacts(_Gpus, total=False):
    """:func:`~flash_recipe.env.probes.probe_gpus`: each GPU and the driver."""

    torch_error: str  # torch failed to list the GPUs


class _Nvcc(TypedDict):
    path: Optional[str]
    version: Optional[str]  # the CUDA release: "12.8"
    cuda_home: Optional[str]  # CUDA_HOME, else CUDA_PATH
    on_path: bool


class NvccFacts(_Nvcc, total=False):
    """:func:`~flash_recipe.env.probes.probe_nvcc`; ``error`` when nvcc runs but names no release."""

    error: str


class _CompileCheck(TypedDict):
    arch: str  # "sm90", "gfx942"
    ok: Optional[bool]  # None: nothing was compiled (no table for this arch, or the interpreter is on)


class CompileCheck(_CompileCheck, total=False):
    """:func:`~flash_recipe.env.probes.triton_compile_check`: ``arch`` and ``ok`` always; ``error``
    when not ok; when it compiled, the compiled kernel's shared memory against the limit, its warps
    and pipeline stages, the seconds the compile took, and ``problems`` (shared memory over the limit)."""

    error: str
    case: str  # "fwd-float16-d64-aligned": call, dtype, head dim, form, as the compile check names its cases
    shared_bytes: int
    shared_limit: int
    num_warps: int
    num_stages: int
    seconds: float
    problems: list[str]


class _Triton(TypedDict):
    installed: bool
    version: Optional[str]
    target: Optional[str]  # "cuda:90", "hip:gfx942"; None without a GPU


class TritonFacts(_Triton, total=False):
    """:func:`~flash_recipe.env.probes.probe_triton`: ``target_error`` when there is no GPU target,
    else ``compile``."""

    target_error: str
    compile: CompileCheck


class BuildToolsFacts(TypedDict):
    """:func:`~flash_recipe.env.probes.probe_build_tools`."""

    ninja: Optional[str]  # the ninja binary on PATH
    ninja_version: Optional[str]
    packages: dict[str, Optional[str]]  # build tool -> installed version, None when missing
    missing: list[str]


class EnvVarFacts(TypedDict, total=False):
    """:func:`~flash_recipe.env.probes.probe_env_vars`: each of ``BUILD_ENV_VARS`` that is set, verbatim."""

    FLASH_ATTENTION_FORCE_BUILD: str
    FLASH_ATTENTION_SKIP_CUDA_BUILD: str
    FLASH_ATTENTION_FORCE_CXX11_ABI: str
    FLASH_ATTN_CUDA_ARCHS: str
    MAX_JOBS: str
    NVCC_THREADS: str
    CUDA_HOME: str
    CUDA_PATH: str
    TORCH_CUDA_ARCH_LIST: str
    PIP_NO_BUILD_ISOLATION: str
    UV_NO_BUILD_ISOLATION: str


class WheelNameParts(TypedDict):
    """:func:`flash_recipe.env.wheels.parse_wheel_filename`: the coupling an upstream wheel name carries."""

    version: str
    cuda_label: str  # "cu12", "rocm63"
    torch: str  # "2.8"
    cxx11abi: bool
    python: str  # "3.12"
    python_tag: str  # "cp312"
    platform: str


class WheelFileFacts(TypedDict):
    """:func:`flash_recipe.env.wheels.inspect_wheel_file`: a wheel file named with ``doctor --wheel``."""

    filename: str
    name_version: str  # the version in the file name, local label included
    metadata_version: Optional[str]  # the version its METADATA states
    tags: list[str]  # from its WHEEL file
    name_parts: Optional[WheelNameParts]


class _FlashAttnInstalled(TypedDict):
    installed: bool
    name: str


class FlashAttnFacts(_FlashAttnInstalled, total=False):
    """:func:`~flash_recipe.env.probes.probe_flash_attn`: ``installed`` and ``name`` always; the
    ``distribution_info`` keys and the wheel's once installed; ``module_location`` and the import
    check's whenever ``import flash_attn`` finds a package, installed as a distribution or not."""

    version: str
    location: Optional[str]
    installer: Optional[str]
    editable: bool
    direct_url: Optional[str]
    vcs: Optional[dict[str, str]]
    wheel_tags: list[str]
    extension_files: list[str]
    wheel_filename: Optional[str]
    wheel_name_parts: Optional[WheelNameParts]
    module_location: Optional[str]  # where `import flash_attn` finds the package (with or without dist-info)
    module_error: Optional[str]  # why flash_attn_2_cuda does not import; None when it does
    package_error: Optional[str]
    loads: bool


class _Flex(TypedDict):
    module: bool  # torch.nn.attention.flex_attention imports
    torch_ok: bool  # torch >= 2.5
    device: bool  # a CUDA device


class FlexFacts(_Flex, total=False):
    """:func:`~flash_recipe.env.probes.probe_flex`."""

    reason: str
    module_error: str
    device_error: str


class LibrariesFacts(TypedDict):
    """:func:`~flash_recipe.env.probes.probe_libraries`: the installed version of each library that
    loads attention kernels from the Hugging Face Hub, None when it is not installed."""

    transformers: Optional[str]
    kernels: Optional[str]


class BackendsFacts(TypedDict):
    """:func:`~flash_recipe.env.probes.probe_backends`: backend name -> None (can run) or why not."""

    available: dict[str, Optional[str]]  # is_available() of each backend
    call: str  # the call explain() was asked about
    explain: dict[str, Optional[str]]  # flash_recipe.explain for that call


class SdpaKernelResult(TypedDict):
    """One kernel of :func:`~flash_recipe.env.probes.sdpa_kernel_check`."""

    ok: bool
    error: Optional[str]
    warnings: list[str]  # torch's warnings, "(Triggered internally at ...)" dropped


class SdpaKernels(TypedDict, total=False):
    """:func:`~flash_recipe.env.probes.sdpa_kernel_check`: both kernels, or ``error`` (torch < 2.3)."""

    FLASH_ATTENTION: SdpaKernelResult
    EFFICIENT_ATTENTION: SdpaKernelResult
    error: str


class SdpaDevice(TypedDict):
    name: str
    capability: list[int]


class _Sdpa(TypedDict):
    device: Optional[SdpaDevice]
    kernels: SdpaKernels  # {} when nothing ran


class SdpaFacts(_Sdpa, total=False):
    """:func:`~flash_recipe.env.probes.probe_sdpa`; ``reason`` when nothing ran."""

    reason: str


class _Network(TypedDict):
    url: str
    reachable: bool


class NetworkFacts(_Network, total=False):
    """:func:`~flash_recipe.env.probes.probe_network`: ``status`` and ``seconds`` when the host
    answered, ``error`` when it did not."""

    status: int
    seconds: float
    error: str


class TorchIndex(TypedDict):
    """The package index a project takes torch from."""

    name: str
    url: str  # credentials dropped
    pinned: bool  # the project names this index for torch


class ProjectFacts(TypedDict):
    """:func:`~flash_recipe.env.project.probe_project`: the project in the current directory."""

    directory: str
    pyproject: bool
    installer: str  # "pip", "uv" or "poetry"
    installer_reason: str
    declares_flash_attn: bool
    uv_flash_attn_build_config: bool
    torch_index: Optional[TorchIndex]


class _Release(TypedDict):
    repository: Optional[str]  # [project.urls] Repository
    checkout: Optional[str]  # the source tree flash_recipe runs from, or None
    on_index: Optional[bool]  # the configured index serves flash-recipe; None when it could not be asked


class ReleaseFacts(_Release, total=False):
    """:func:`~flash_recipe.env.release.probe_release`: where flash-recipe can be installed from."""

    index_error: str


class Facts(TypedDict, total=False):
    """Probe name -> what it found (or :class:`ProbeError`). ``project``, ``release`` and ``network``
    are added by the doctor (``network`` only with ``--online``); ``collect`` runs the others."""

    platform: Union[PlatformFacts, ProbeError]
    torch: Union[TorchFacts, ProbeError]
    gpus: Union[GpusFacts, ProbeError]
    nvcc: Union[NvccFacts, ProbeError]
    triton: Union[TritonFacts, ProbeError]
    build: Union[BuildToolsFacts, ProbeError]
    env: Union[EnvVarFacts, ProbeError]
    flash_attn: Union[FlashAttnFacts, ProbeError]
    flex: Union[FlexFacts, ProbeError]
    sdpa: Union[SdpaFacts, ProbeError]
    backends: Union[BackendsFacts, ProbeError]
    libraries: Union[LibrariesFacts, ProbeError]
    project: Union[ProjectFacts, ProbeError]
    network: Union[NetworkFacts, ProbeError]
    release: Union[ReleaseFacts, ProbeError]
