"""The doctor's rules, one per known FlashAttention install failure, loaded in one place.

Importing this module registers every rule (:mod:`flash_recipe.env.rules_build`, then
:mod:`flash_recipe.env.rules_runtime`) in :data:`flash_recipe.env.findings.RULES`; the doctor and
the tests import :class:`Context`, :class:`Finding` and :func:`evaluate` from here.
"""

from __future__ import annotations

from . import commands, rules_build, rules_runtime
from .findings import RULES, SEVERITIES, Context, Finding, evaluate, rule
from .rules_runtime import TURING_ISSUES

# The modules whose import registers the rules, in the order they run.
RULE_MODULES = (rules_build, rules_runtime)


def cited_recipes() -> set[str]:
    """Every recipe folder name a rule or ``flash-recipe recipe`` can cite (a test checks that each
    exists under recipes/)."""
    names = {"upstream-flash-attn", "pip-no-build-isolation", "uv-project", "uv-pip", "poetry-index"}
    names |= {"pip-git", "poetry-git", "poetry-path"}  # flash-recipe recipe, where the index lacks flash-recipe
    names |= {f"torch-index-{installer}" for installer in commands.INSTALLERS}
    return names


__all__ = [
    "RULES",
    "RULE_MODULES",
    "SEVERITIES",
    "TURING_ISSUES",
    "Context",
    "Finding",
    "cited_recipes",
    "evaluate",
    "rule",
]
