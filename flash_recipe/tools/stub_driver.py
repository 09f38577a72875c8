"""Triton's own launch path on a machine without a GPU: a stub CUDA driver library.

A test double for the one thing a CPU machine lacks, the CUDA driver (``libcuda.so.1``). Inside
``stub_cuda()``:

- a stub ``libcuda.so.1``, built here from ``STUB_SOURCE`` with the C compiler, is loaded first,
  so that Triton's C driver module and launchers link and load against it. Its entry points
  return success; it reports one device of the chosen compute capability with H100-sized limits,
  answers a pointer's device address with the address itself (a CPU tensor's memory), and
  ``cuLaunchKernel``/``cuLaunchKernelEx`` run nothing: they count the launch and keep its grid,
  block and shared memory (``launches()``);
- ``StubDriver``, a subclass of Triton's ``CudaDriver``, is the active driver: Triton's real
  utilities and launcher (``CudaUtils``, ``CudaLauncher``), built against the stub, with the
  current device 0 and stream 0 answered by builtins (no Python frame, as torch's C getter of the
  current stream enters none).

So every line of Triton's ``JITFunction.run`` runs for real on CPU tensors (binding, specialisation,
the cache lookup, ``launch_metadata``, the C launcher with its pointer checks) and kernels compile
for the target for real (Triton ships ptxas). Nothing runs on a device and no output is written:
the host path alone is measured (``flash_recipe.tools.host_cost``). What the stub cannot give is
said where it matters: no kernel's registers (``cuFuncGetAttribute`` answers 0), and the
device's properties are an H100's whatever the capability.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime.driver import driver

from ..ops import targets

# The multiprocessors the stub reports (an H100's, H200's): ``cuDeviceGetAttribute``'s answer 16.
STUB_SMS = 132
_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
typedef int CUresult;
typedef struct {
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void *hStream;
  void *attrs;
  unsigned numAttrs;
} StubLaunchConfig;

#define STUB_SMS @STUB_SMS@
static int major = 9, minor = 0;
static long long launch_count = 0;
static unsigned last[7];
static int dummy_object;

void stub_set_capability(int ma, int mi) { major = ma; minor = mi; }
long long stub_launch_count(void) { return launch_count; }
void stub_last_launch(unsigned *out) { memcpy(out, last, sizeof(last)); }

static void record(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared) {
  unsigned values[7] = {gx, gy, gz, bx, by, bz, shared};
  memcpy(last, values, sizeof(last));
  launch_count++;
}

static int device_attribute(int attribute) {
  switch (attribute) {
  case 1: return 1024;      /* max threads per block */
  case 8: return 49152;     /* shared memory per block */
  case 10: return 32;       /* warp size */
  case 12: return 65536;    /* registers per block */
  case 13: return 1980000;  /* clock rate, kHz */
  case 16: return STUB_SMS; /* multiprocessors */
  case 36: return 2619000;  /* memory clock rate, kHz */
  case 37: return 5120;     /* memory bus width, bits */
  case 75: return major;
  case 76: return minor;
  case 97: return 232448;   /* shared memory per block, opt-in */
  case 150: return 232448;  /* oversized shared memory per block */
  default: return 1;
  }
}

CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = 0; return 0; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return 0; }
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  *value = device_attribute(attribute);
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = &dummy_object; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = &dummy_object; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return 0; }
CUresult cuCtxGetDevice(int *device) { *device = 0; return 0; }
CUresult cuCtxGetLimit(size_t *value, int limit) { *value = 0; return 0; }
CUresult cuCtxSetLimit(int limit, size_t value) { return 0; }
CUresult cuStreamIsCapturing(void *stream, int *status) { *status = 0; return 0; }
CUresult cuGetErrorString(CUresult error, const char **text) { *text = "stub driver"; return 0; }
CUresult cuModuleLoadData(void **module, const void *image) { *module = &dummy_object; return 0; }
CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
  *function = &dummy_object;
  return 0;
}
CUresult cuModuleUnload(void *module) { return 0; }
CUresult cuFuncGetAttribute(int *value, int attribute, void *function) {
  *value = attribute == 0 ? 1024 : 0; /* max threads per block; registers, local bytes: unknown */
  return 0;
}
CUresult cuFuncSetAttribute(void *function, int attribute, int value) { return 0; }
CUresult cuFuncSetCacheConfig(void *function, int config) { return 0; }
CUresult cuOccupancyMaxActiveClusters(int *clusters, void *function, const void *config) {
  *clusters = 1;
  return 0;
}
CUresult cuPointerGetAttribute(void *data, int attribute, uint64_t pointer) {
  if (attribute == 2) { *(uint64_t *)data = pointer; return 0; } /* device pointer: the address */
  memset(data, 0, sizeof(uint64_t));
  return 0;
}
CUresult cuPointerGetAttributes(unsigned count, int *attributes, void **data, uint64_t pointer) {
  for (unsigned i = 0; i < count; i++)
    if (data[i]) *(uint64_t *)data[i] = attributes[i] == 2 ? pointer : 0;
  return 0;
}
CUresult cuTensorMapEncodeTiled() { return 0; }
CUresult cuTensorMapEncodeIm2col() { return 0; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
  record(gx, gy, gz, bx, by, bz, shared);
  return 0;
}
CUresult cuLaunchKernelEx(const StubLaunchConfig *c, void *f, void **params, void **extra) {
  record(c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
         c->sharedMemBytes);
  return 0;
}
CUresult cuMemAlloc(uint64_t *pointer, size_t size) { *pointer = 0; return 0; }
CUresult cuMemFree(uint64_t pointer) { return 0; }
CUresult cuGetProcAddress() { return 1; }
"""
STUB_SOURCE = _SOURCE.replace("@STUB_SMS@", str(STUB_SMS))

_LIBRARY: Optional[ctypes.CDLL] = None


def build_stub(directory: Optional[Path] = None) -> Path:
    """The stub ``libcuda.so.1``, compiled once per source into ``directory`` (default: a folder of
    the system's temporary directory named by the source's hash); returns its folder."""
    digest = hashlib.sha256(STUB_SOURCE.encode()).hexdigest()[:16]
    folder = Path(directory or Path(tempfile.gettempdir()) / f"flash-recipe-stub-libcuda-{digest}")
    library = folder / "libcuda.so.1"
    if library.exists():
        return folder
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the stub CUDA driver needs a C compiler (cc or gcc on PATH, or CC)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = Path(work) / "stub_libcuda.c"
        source.write_text(STUB_SOURCE)
        built = Path(work) / "libcuda.so.1"
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(built), str(source)]
        subprocess.run(cmd, check=True, capture_output=True)
        link = Path(work) / "libcuda.so"  # what ``-lcuda`` (Triton 3.2's modules) looks for
        link.symlink_to("libcuda.so.1")
        os.replace(link, folder / "libcuda.so")
        os.replace(built, library)  # last and atomic: a library there means a whole stub
    return folder


def _library() -> ctypes.CDLL:
    """The stub, loaded once into the process's global namespace: a later ``dlopen("libcuda.so.1")``
    (Triton's modules and launchers) finds it by its soname instead of looking on disk."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = ctypes.CDLL(str(build_stub() / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    return _LIBRARY


def launches() -> int:
    """Kernel launches the stub has received in this process."""
    return int(_library().stub_launch_count())


def last_launch() -> dict:
    """The grid, block and dynamic shared memory of the stub's last launch."""
    values = (ctypes.c_uint * 7)()
    _library().stub_last_launch(values)
    return {"grid": tuple(values[:3]), "block": tuple(values[3:6]), "shared": values[6]}


def stub_driver_class():
    """``StubDriver``: Triton's ``CudaDriver`` on the stub library, device 0, stream 0."""

    class StubDriver(CudaDriver):
        """Triton's CUDA driver with the stub library below it: device 0 and stream 0, answered by
        builtins (``dict.get``), so that asking enters no Python frame."""

        def __init__(self, capability: tuple[int, int]):
            super().__init__()
            self.capability = capability
            self.get_current_device = (0).__index__
            self.get_current_stream = {0: 0, None: 0}.get
            self.get_device_capability = {0: capability, None: capability}.get

        def set_current_device(self, device):
            return None

        def get_active_torch_device(self):
            return torch.device("cpu")

    return StubDriver


@contextlib.contextmanager
def stub_cuda(target: str = "sm90") -> Iterator[object]:
    """Inside the block Triton's active driver is a ``StubDriver`` for ``target`` (``"sm80"`` to
    ``"sm121"``) on the stub library; yields the driver. ``TRITON_INTERPRET`` must be unset: the
    interpreter never reaches a driver."""
    if targets.interpreter_enabled():
        raise RuntimeError(
            "unset TRITON_INTERPRET: the stub driver stands below Triton's compiler, not its interpreter"
        )
    capability = (int(target[2:-1]), int(target[-1]))
    library = _library()
    library.stub_set_capability(*capability)
    saved_path = os.environ.get("TRITON_LIBCUDA_PATH")
    os.environ["TRITON_LIBCUDA_PATH"] = str(build_stub())
    saved = dict(vars(driver))  # the active driver's slot is named differently across Triton releases
    try:
        with contextlib.suppress(ImportError, AttributeError):
            from triton import knobs  # Triton 3.4 and newer read the library's path from knobs

            knobs.nvidia.libcuda_path = str(build_stub())
        stub = stub_driver_class()(capability)
        driver.set_active(stub)
        yield stub
    finally:
        vars(driver).clear()
        vars(driver).update(saved)
        if saved_path is None:
            os.environ.pop("TRITON_LIBCUDA_PATH", None)
        else:
            os.environ["TRITON_LIBCUDA_PATH"] = saved_path
