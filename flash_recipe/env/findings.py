"""The doctor's findings and the rule registry.

A rule reads the probe facts (and, when given, an install log or a wheel file) and returns a
:class:`Finding` or None. Each finding carries a severity, the evidence it saw and the fix: the
recipe folder under ``recipes/`` that documents the cure and the exact command for this
environment. :class:`Context` is what the rules read; :func:`rule` registers one; :func:`evaluate`
runs them all. The rules themselves live in :mod:`flash_recipe.env.rules_build` (the failures of
building and loading upstream flash-attn) and :mod:`flash_recipe.env.rules_runtime` (GPUs, SDPA,
torch, Triton and flash_recipe's own backends); :mod:`flash_recipe.env.rules` loads both.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Optional

from . import commands
from .facts import (
    BackendsFacts,
    BuildToolsFacts,
    EnvVarFacts,
    Facts,
    FlashAttnFacts,
    FlexFacts,
    GpusFacts,
    LibrariesFacts,
    NetworkFacts,
    NvccFacts,
    PlatformFacts,
    ProjectFacts,
    ReleaseFacts,
    SdpaFacts,
    TorchFacts,
    TritonFacts,
    WheelFileFacts,
)
from .published import LATEST
from .wheels import resolve

SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass
class Finding:
    """One diagnosis: what is wrong, how we know, and the fix to paste."""

    rule: str
    title: str
    severity: str
    evidence: list[str]
    recipe: str  # the folder under recipes/ that documents the cure; "" where the command is all of it
    command: str
    failure: Optional[int] = None
    note: Optional[str] = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Context:
    """What the rules look at: probe facts plus what the user handed the doctor.

    Rules read a probe's facts through the property of the same name (``ctx.torch``, ``ctx.gpus``),
    typed by :mod:`flash_recipe.env.facts`; a test checks that every key a rule reads there is
    declared. A probe that was not run reads as ``{}``, one that failed as ``{"error": ...}``, so
    rules read keys with ``.get()`` unless they know the probe ran.
    """

    facts: Facts
    log: Optional[str] = None
    wheel: Optional[WheelFileFacts] = None  # a wheel file named with --wheel ({"error": ...} when unreadable)
    flash_attn_version: Optional[str] = None  # asked with --flash-attn-wheel
    installer: str = "pip"
    project: ProjectFacts = dataclasses.field(default_factory=dict)  # the project probe's facts ({} when none)

    # -- each probe's facts ----------------------------------------------------------------------
    def _probe(self, name: str) -> Any:
        value = self.facts.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def platform(self) -> PlatformFacts:
        return self._probe("platform")

    @property
    def torch(self) -> TorchFacts:
        return self._probe("torch")

    @property
    def gpus(self) -> GpusFacts:
        return self._probe("gpus")

    @property
    def nvcc(self) -> NvccFacts:
        return self._probe("nvcc")

    @property
    def triton(self) -> TritonFacts:
        return self._probe("triton")

    @property
    def build(self) -> BuildToolsFacts:
        return self._probe("build")

    @property
    def env(self) -> EnvVarFacts:
        return self._probe("env")

    @property
    def flash_attn(self) -> FlashAttnFacts:
        return self._probe("flash_attn")

    @property
    def flex(self) -> FlexFacts:
        return self._probe("flex")

    @property
    def sdpa(self) -> SdpaFacts:
        return self._probe("sdpa")

    @property
    def backends(self) -> BackendsFacts:
        return self._probe("backends")

    @property
    def libraries(self) -> LibrariesFacts:
        return self._probe("libraries")

    @property
    def network(self) -> NetworkFacts:
        return self._probe("network")

    @property
    def release(self) -> ReleaseFacts:
        return self._probe("release")

    # -- shortcuts -------------------------------------------------------------------------------
    @property
    def version(self) -> str:
        fa = self.flash_attn
        if self.flash_attn_version:
            return self.flash_attn_version
        if fa.get("installed") and fa.get("version"):
            return fa["version"].split("+")[0]
        return LATEST

    @property
    def flash_attn_in_play(self) -> bool:
        env = self.env
        return bool(
            self.flash_attn.get("installed")
            or self.project.get("declares_flash_attn")
            or self.flash_attn_version
            or self.log
            or self.wheel
            or any(name.startswith("FLASH_ATTENTION_") or name.startswith("FLASH_ATTN_") for name in env)
        )

    def log_lines(self, pattern: str) -> list[str]:
        """Lines of the log matching ``pattern`` (regex), stripped and shortened."""
        if not self.log:
            return []
        rx = re.compile(pattern)
        return [line.strip()[:240] for line in self.log.splitlines() if rx.search(line)]

    def resolved(self) -> dict[str, Any]:
        """The upstream wheel for this environment (see :func:`flash_recipe.env.wheels.resolve`);
        a version whose naming is not recorded gives status ``unknown-release`` instead of raising."""
        try:
            return self._resolve()
        except ValueError as exc:
            return {
                "version": self.version,
                "filename": None,
                "url": None,
                "nearest": None,
                "status": "unknown-release",
                "reason": str(exc),
            }

    def _resolve(self) -> dict[str, Any]:
        torch = self.torch
        plat = self.platform
        return resolve(
            self.version,
            python=plat.get("python") or "3",
            torch=torch.get("version") if torch.get("installed") else None,
            cxx11abi=torch.get("cxx11abi"),
            cuda=torch.get("cuda"),
            hip=torch.get("hip"),
            platform=plat.get("wheel_platform") or "linux_x86_64",
        )

    @property
    def cpu_only_torch(self) -> bool:
        """torch imports and is a CPU-only build: no flash-attn can be built or loaded against it."""
        torch = self.torch
        return bool(torch.get("installed")) and not torch.get("import_error") and torch.get("build") == "cpu"

    def cuda_torch_fix(self) -> tuple[str, str]:
        """(recipe, command) for a CPU-only torch: flash-attn needs a CUDA build of torch first, and
        flash_recipe runs without one. Never a flash-attn build, which cannot work here."""
        command = (
            "# flash-attn needs a CUDA build of torch; this torch is CPU-only, so no flash-attn wheel or build "
            "can load here.\n"
            "# flash_recipe runs without one (torch SDPA on the CPU). For flash-attn, on a machine with an "
            "NVIDIA GPU, take a CUDA torch first:\n" + commands.install_cuda_torch(self.facts, self.installer)
        )
        return f"torch-index-{self.installer}", command

    def wheel_fix(self) -> tuple[str, str]:
        """(recipe, command) installing the published wheel for this environment, or a source build;
        on a CPU-only torch, :meth:`cuda_torch_fix` instead."""
        if self.cpu_only_torch:
            return self.cuda_torch_fix()
        res = self.resolved()
        if res["status"] == "published":
            return "upstream-flash-attn", commands.install_wheel_url(res["url"], self.installer)
        return self.build_fix(force_build=True)

    def build_fix(self, force_build: bool = False) -> tuple[str, str]:
        """(recipe, command) building flash-attn against the installed torch with build isolation
        off; on a CPU-only torch, :meth:`cuda_torch_fix` instead."""
        if self.cpu_only_torch:
            return self.cuda_torch_fix()
        command = commands.no_build_isolation(self.facts, self.installer, self.version, force_build=force_build)
        return "upstream-flash-attn", command


# A rule's finding, named after the rule: finding(title, severity, evidence, recipe, command, failure=, note=).
Build = Callable[..., Finding]
# A rule as written: it reads the context and returns finding(...) or None.
RuleFunction = Callable[[Context, Build], Optional[Finding]]
# A rule as registered: the context alone.
Rule = Callable[[Context], Optional[Finding]]
RULES: list[tuple[str, Rule]] = []


def rule(name: str) -> Callable[[RuleFunction], RuleFunction]:
    """Register a rule under ``name``, its one spelling: :data:`RULES` gets ``(name, check)`` where
    ``check(ctx)`` calls the rule with ``ctx`` and a ``finding`` builder, :class:`Finding` with
    ``rule=name`` filled in. The rule function itself is returned unchanged."""

    def register(fn: RuleFunction) -> RuleFunction:
        named = functools.partial(Finding, name)
        RULES.append((name, lambda ctx: fn(ctx, named)))
        return fn

    return register


SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def evaluate(ctx: Context) -> list[Finding]:
    """Run every rule; a rule that raises becomes an ``info`` finding naming the rule, not a crash."""
    findings = []
    for name, fn in RULES:
        try:
            found = fn(ctx)
        except Exception as exc:  # one broken rule must not hide the others
            evidence = [f"{type(exc).__name__}: {exc}"]
            found = Finding(name, f"rule {name} could not be evaluated", "info", evidence, "upstream-flash-attn", "")
        if found is not None:
            findings.append(found)
    findings.sort(key=lambda f: SEVERITY_ORDER[f.severity])
    return findings
