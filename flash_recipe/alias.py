"""Stand-ins: let code that imports ``flash_attn``, ``flash_attn_interface`` (FlashAttention-3) or
``sageattention`` run on flash_recipe.

Many libraries import flash-attn by name (ring-flash-attn, yunchang, ColossalAI, Unsloth, ...),
others ask for FlashAttention-3 (transformers' ``flash_attention_3``, diffusers' ``_flash_3``),
and diffusion code imports SageAttention by name (diffusers' ``sage`` backends, ComfyUI's
``--use-sage-attention``). After ``install_as_flash_attn()``, ``install_as_flash_attn_3()`` or
``install_as_sageattention()`` these imports resolve to flash_recipe's stand-in packages, the way
``pymysql.install_as_MySQLdb()`` stands in for MySQLdb::

    flash_attn                       -> flash_recipe.flash_attn (``__version__`` "2.8.3")
    flash_attn.flash_attn_interface  -> public and internal functions (``_flash_attn_forward``, ...)
    flash_attn.bert_padding          -> unpad_input, pad_input, index_first_axis, index_put_first_axis
    flash_attn.layers.rotary         -> apply_rotary_emb
    sageattention                    -> flash_recipe.sageattention (``__version__`` "2.2.0"):
                                        sageattn, sageattn_varlen, sageattn_qk_int8_pv_* (8-bit)
    flash_attn_interface             -> flash_recipe.flash_attn_3.flash_attn_interface: FA3 3.0.0's
                                        functions; flash_attn_3 (``__version__`` "3.0.0") and
                                        flash_attn_config beside it

One mechanism serves both (``StandIn`` below describes each). Any other module or name of the
package raises ImportError (AttributeError for an attribute) naming what is missing and what is
provided. While a stand-in is installed, ``importlib.metadata`` answers for its distribution in
this process (``StandInDistribution``; nothing is written to disk), so libraries that check the
version at import time (diffusers, transformers, ComfyUI nodes) see it: install the stand-in before
importing them. A working upstream package is never shadowed unless ``force=True``; one that is
installed but fails to import is replaced, with a warning.

This module imports nothing of flash_recipe except by name, when a stand-in is installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StandIn:
    """One upstream package that flash_recipe stands in for."""

    package: str  # the top-level module code imports: "flash_attn"
    module: str  # flash_recipe's package that stands in for it, relative to flash_recipe: ".flash_attn"
    provided: tuple[str, ...]  # the modules provided, by the names code imports
    distribution: str  # the distribution's name on PyPI (normalized): "flash-attn"
    probe: str  # the module whose import tells a working upstream install from a broken one
    installer: str  # the function that installs it, for messages
    tops: tuple[str, ...] = ()  # other top-level modules the distribution installs, served from the package
    # Submodules that other code probes for with ``importlib.util.find_spec`` (xformers asks for
    # ``flash_attn_3._C``): not found, as Python answers a probe, rather than refused.
    probed: tuple[str, ...] = ()

    def source(self, name: str) -> str:
        """flash_recipe's module, relative to flash_recipe, that serves the provided module ``name``:
        ``flash_attn.bert_padding`` -> ``.flash_attn.bert_padding``, a top-level ``flash_attn_interface``
        of FA3 -> ``.flash_attn_3.flash_attn_interface``."""
        if name.partition(".")[0] == self.package:
            return self.module + name[len(self.package) :]
        return f"{self.module}.{name}"


FLASH_ATTN = StandIn(
    package="flash_attn",
    module=".flash_attn",
    provided=(
        "flash_attn",
        "flash_attn.flash_attn_interface",
        "flash_attn.bert_padding",
        "flash_attn.layers",
        "flash_attn.layers.rotary",
    ),
    distribution="flash-attn",
    probe="flash_attn.flash_attn_interface",
    installer="install_as_flash_attn",
)
SAGEATTENTION = StandIn(
    package="sageattention",
    module=".sageattention",
    provided=("sageattention", "sageattention.core"),
    distribution="sageattention",
    probe="sageattention",  # upstream's package imports its kernels' modules at import
    installer="install_as_sageattention",
)
FLASH_ATTN_3 = StandIn(
    package="flash_attn_3",
    module=".flash_attn_3",
    provided=(
        "flash_attn_3",
        "flash_attn_3.flash_attn_interface",
        "flash_attn_3.flash_attn_config",
        "flash_attn_interface",
        "flash_attn_config",
    ),
    distribution="flash-attn-3",
    probe="flash_attn_interface",
    installer="install_as_flash_attn_3",
    tops=("flash_attn_interface", "flash_attn_config"),
    probed=("flash_attn_3._C",),
)
STAND_INS = {stand_in.package: stand_in for stand_in in (FLASH_ATTN, SAGEATTENTION, FLASH_ATTN_3)}

# The INSTALLER text of the in-memory metadata: ``is_stand_in(dist)`` and the doctor
# (``flash_recipe.env.distinfo``) tell the stand-ins from real installs by it.
INSTALLER = "flash-recipe-stand-in"


def _stand_in(package: str) -> StandIn:
    stand_in = STAND_INS.get(package)
    if stand_in is None:
        raise ValueError(f"package must be one of {', '.join(sorted(STAND_INS))}, got {package!r}")
    return stand_in


def missing(module: str, name: str, provided) -> AttributeError:
    """The error for a name the stand-in's ``module`` (``flash_attn.bert_padding``,
    ``sageattention``, ...) does not have (``from module import name`` turns it into an
    ImportError naming ``name``)."""
    if name.startswith("__") and name.endswith("__"):  # Python's own probes (__path__, __file__, ...)
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    top = module.partition(".")[0]
    stand_in = next((s for s in STAND_INS.values() if top in s.tops), None) or _stand_in(top)
    return AttributeError(
        f"flash_recipe's stand-in for {stand_in.distribution} does not provide {module}.{name}; {module} provides: "
        f"{', '.join(sorted(provided))} (install the {stand_in.distribution} package for the rest)"
    )


def is_installed(package: str = "flash_attn") -> bool:
    """Whether ``import <package>`` (``flash_attn`` unless given; ``sageattention`` or
    ``flash_attn_3``) gives flash_recipe's stand-in in this process."""
    stand_in = STAND_INS.get(package) or _stand_in(package)  # the dispatcher asks on every call: no call on a hit
    return getattr(sys.modules.get(stand_in.package), "__flash_recipe__", False)


def _other_packages(package: str) -> list:
    """The folders named ``package`` on ``sys.path`` that hold no ``__init__.py``: parts of a
    namespace package that other distributions install there (flash-attn-4 installs
    ``flash_attn/cute`` alone), which the stand-in leaves reachable."""
    found = []
    for entry in sys.path:
        folder = Path(entry or ".") / package
        if folder.is_dir() and not (folder / "__init__.py").exists():
            found.append(str(folder))
    return found


class _MissingModules(importlib.abc.MetaPathFinder):
    """Finds a subpackage of an installed stand-in's package that another distribution installs
    beside it (``_other_packages``: flash-attn-4's ``flash_attn.cute``); raises a clear ImportError
    for any other submodule that the stand-in does not provide."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, rest = fullname.partition(".")
        stand_in = STAND_INS.get(package)
        if stand_in is not None and fullname != package and is_installed(package):
            parent = sys.modules.get(fullname.rpartition(".")[0])
            if not getattr(parent, "__name__", "").startswith(f"{__package__}."):
                return None  # inside another distribution's subpackage: found on its own path
            if "." not in rest:
                spec = importlib.machinery.PathFinder.find_spec(fullname, _other_packages(package))
                if spec is not None:
                    return spec
            if fullname in stand_in.probed:
                return None
            raise ModuleNotFoundError(
                f"flash_recipe's stand-in for {stand_in.distribution} does not provide the module {fullname}; it "
                f"provides {', '.join(stand_in.provided)} (install the {stand_in.distribution} package for the rest)",
                name=fullname,
            )
        return None


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class StandInDistribution(importlib.metadata.Distribution):
    """An installed stand-in's distribution metadata, answered from memory: ``Name`` is the
    upstream distribution's, ``Version`` the stand-in's ``__version__``."""

    def __init__(self, stand_in: StandIn):
        self.stand_in = stand_in

    def read_text(self, filename):
        module = sys.modules.get(self.stand_in.package)
        files = {
            "METADATA": (
                f"Metadata-Version: 2.1\nName: {self.stand_in.distribution}\n"
                f"Version: {getattr(module, '__version__', '')}\n"
                f"Summary: flash_recipe's in-process stand-in for {self.stand_in.distribution} "
                f"({self.stand_in.installer})\n"
            ),
            "INSTALLER": INSTALLER + "\n",
            "top_level.txt": "".join(f"{top}\n" for top in (self.stand_in.package, *self.stand_in.tops)),
        }
        return files.get(str(filename))

    def locate_file(self, path):
        return Path(__file__).parent / path


def is_stand_in(dist: importlib.metadata.Distribution) -> bool:
    """Whether ``dist`` is a stand-in's in-memory metadata (not an install on disk)."""
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


class _Metadata(importlib.metadata.DistributionFinder):
    """Answers ``importlib.metadata`` for each installed stand-in (any spelling of its name:
    ``flash_attn``, ``Flash-Attn``); finds no modules."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        context = context if context is not None else importlib.metadata.DistributionFinder.Context()
        wanted = None if context.name is None else _normalized(context.name)
        return iter(
            StandInDistribution(stand_in)
            for stand_in in STAND_INS.values()
            if is_installed(stand_in.package) and wanted in (None, stand_in.distribution)
        )


_FINDER = _MissingModules()
METADATA_FINDER = _Metadata()


def _upstream_problem(stand_in: StandIn) -> tuple:
    """``(found, error)``: whether the upstream package is installed, and why it fails to import
    (None if it imports)."""
    spec = importlib.util.find_spec(stand_in.package)
    if spec is None:
        return False, None
    if spec.origin is None and importlib.util.find_spec(stand_in.probe) is None:
        return False, None  # a namespace of other distributions' subpackages (flash-attn-4's flash_attn.cute)
    try:
        importlib.import_module(stand_in.probe)
    except Exception as exc:  # a broken build raises anything from ImportError to OSError
        return True, f"{type(exc).__name__}: {exc}"
    return True, None


def _upstream_version(stand_in: StandIn) -> str:
    version = getattr(sys.modules.get(stand_in.package), "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(stand_in.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
    return str(version)


def install(stand_in: StandIn, force: bool = False) -> bool:
    """Make ``import <stand_in.package>`` and the modules in ``stand_in.provided`` resolve to
    flash_recipe, and ``importlib.metadata`` answer for its distribution; the two public
    functions below call it. Returns and warns as they document."""
    if not isinstance(force, bool):
        raise TypeError(f"force must be a bool, got {type(force).__name__}")
    if is_installed(stand_in.package):
        return True
    if not force:
        found, error = _upstream_problem(stand_in)
        if found and error is None:
            warnings.warn(
                f"{stand_in.distribution} {_upstream_version(stand_in)} is installed and imports; "
                f"{stand_in.installer}() leaves it in place (force=True replaces it in this process)",
                stacklevel=3,
            )
            return False
        if found:
            warnings.warn(
                f"{stand_in.distribution} is installed but fails to import ({error}); flash_recipe stands in for it",
                stacklevel=3,
            )
    tops = (stand_in.package, *stand_in.tops)
    for name in [n for n in sys.modules if n.partition(".")[0] in tops]:
        del sys.modules[name]
    for name in stand_in.provided:
        sys.modules[name] = importlib.import_module(stand_in.source(name), __package__)
    for finder in (_FINDER, METADATA_FINDER):
        if finder not in sys.meta_path:
            sys.meta_path.insert(0, finder)
    return True


def install_as_flash_attn(force: bool = False) -> bool:
    """Make ``import flash_attn`` and the modules in ``FLASH_ATTN.provided`` resolve to flash_recipe.

    Arguments:
        force: install even when an upstream flash-attn imports and works; modules of it already
            imported in this process are replaced for later imports (objects taken from them
            before stay what they are).

    Returns:
        True when the stand-in is installed (now or before); False when a working upstream
        flash-attn was found and left in place (a warning says so). An upstream flash-attn that
        fails to import is replaced, with a warning.

    Call it before the imports of the library that needs flash-attn. It affects this process only.
    """
    return install(FLASH_ATTN, force)


def install_as_sageattention(force: bool = False) -> bool:
    """Make ``import sageattention`` resolve to flash_recipe's 8-bit attention (SageAttention 2.2.0's
    functions: ``sageattn``, ``sageattn_varlen``, ``sageattn_qk_int8_pv_fp16_triton``, ...), and
    ``importlib.metadata.version("sageattention")`` answer ``2.2.0`` in this process.

    Arguments:
        force: install even when an upstream SageAttention imports and works; modules of it
            already imported in this process are replaced for later imports (objects taken from
            them before stay what they are).

    Returns:
        True when the stand-in is installed (now or before); False when a working upstream
        SageAttention was found and left in place (a warning says so). An upstream SageAttention
        that fails to import is replaced, with a warning.

    Call it before the imports of the code that uses SageAttention (diffusers decides at import
    whether its ``sage`` backends are usable; ComfyUI imports ``sageattention`` when its attention
    module loads). It affects this process only.
    """
    return install(SAGEATTENTION, force)


def install_as_flash_attn_3(force: bool = False, beta_returns: bool = False) -> bool:
    """Make FlashAttention-3's modules (``flash_attn_interface``, ``flash_attn_3``,
    ``flash_attn_config``) resolve to flash_recipe's stand-in: FA3 3.0.0's functions
    (``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_qkvpacked_func``,
    ``flash_attn_with_kvcache``) on flash_recipe's backends, on every GPU flash_recipe runs on;
    ``importlib.metadata`` answers for ``flash-attn-3`` ``3.0.0`` in this process.

    Arguments:
        force: install even when an upstream FA3 imports and works (as ``install_as_flash_attn``).
        beta_returns: ``flash_attn_func`` and ``flash_attn_varlen_func`` return ``(out,
            softmax_lse)`` whatever ``return_attn_probs`` says, as FA3's beta did before 2025-07;
            code written for it (Wan2.x) indexes ``[0]``. False follows 3.0.0: ``out``, or ``(out,
            softmax_lse)`` with ``return_attn_probs=True``.

    Returns:
        True when the stand-in is installed (now or before); False when a working upstream FA3
        was found and left in place (a warning says so).

    Call it before importing the library that looks for FA3: transformers and diffusers decide at
    import, or at their first check, and remember the answer. It affects this process only.
    """
    if not isinstance(beta_returns, bool):
        raise TypeError(f"beta_returns must be a bool, got {type(beta_returns).__name__}")
    installed = install(FLASH_ATTN_3, force)
    if installed:
        vars(sys.modules["flash_attn_interface"])["beta_returns"] = beta_returns
    return installed
