"""The doctor's facts are typed (flash_recipe.env.facts) and each rule's name is written once.

Statically: every string key the rules, the report and the probes use on a typed fact (``ctx.torch.get("cuda")``,
``d["capability"]`` for ``d`` in ``_old_gpus(ctx)``, ``"MAX_JOBS" in env``) must be declared by its TypedDict; the
checker below follows types from annotations (parameters, ``x: T = ...``, return types, ``cast``, Context's fields
and properties) through assignments, ``or``, ``.get``/subscripts and loops. At run time: the keys this machine's
probes return are the keys their TypedDicts declare.
"""

from __future__ import annotations

import ast
import http.server
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import typing
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Union

import pytest

from flash_recipe.env import doctor, facts, findings, probes, release, rules, rules_build, rules_runtime
from flash_recipe.env.project import probe_project

ENV_DIR = Path(probes.__file__).resolve().parent


# -- the static checker ------------------------------------------------------------------------------------------
def is_typeddict(tp: Any) -> bool:
    plain_class = typing.get_origin(tp) is None and isinstance(tp, type)
    return plain_class and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def atoms(tp: Any) -> tuple:
    """The members of a type: ``Optional[Union[A, B]]`` -> (A, B, NoneType); anything else -> (tp,)."""
    if typing.get_origin(tp) is Union:
        return tuple(member for arg in typing.get_args(tp) for member in atoms(arg))
    return (tp,)


def declared(td: type) -> dict[str, Any]:
    """A TypedDict's keys -> their types."""
    return typing.get_type_hints(td)


_MISSING = object()


class KeyChecker:
    """Infer which expressions of one module hold typed facts and check each string key used on them.

    ``problems``: ``"function:line: TypeName has no key 'x'"`` (or no attribute, for a flash_recipe class such as
    Context); ``checked``: the (TypedDict name, key) pairs seen, so a test can tell the checker reached them.
    """

    def __init__(self, namespace: dict[str, Any]):
        self.namespace = namespace  # the module's globals: annotations and called functions resolve here
        self.problems: list[str] = []
        self.checked: set[tuple[str, str]] = set()
        self.function_name = ""
        self.reporting = False  # off while variables are inferred, on for the pass that checks

    def report(self, node: ast.AST, problem: str) -> None:
        line = f"{self.function_name}:{node.lineno}: {problem}"
        if self.reporting and line not in self.problems:
            self.problems.append(line)

    # the type of an annotation or an expression, as a tuple of atoms (empty: unknown)
    def annotation(self, node: Optional[ast.expr]) -> tuple:
        if node is None:
            return ()
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)
        try:
            return atoms(eval(text, self.namespace))  # an annotation of one of this project's modules
        except Exception:
            return ()

    @staticmethod
    def returns(fn: Any) -> tuple:
        try:
            return atoms(typing.get_type_hints(fn).get("return"))
        except Exception:
            return ()

    def key(self, node: ast.AST, types: tuple, key: str) -> tuple:
        """Check ``key`` on the TypedDicts among ``types``; the type of the value it names."""
        tds = [t for t in types if is_typeddict(t)]
        found = [t for t in tds if key in declared(t)]
        if self.reporting:
            self.checked.update((t.__name__, key) for t in found)
        if tds and not found:
            self.report(node, f"{' | '.join(t.__name__ for t in tds)} has no key {key!r}")
        return tuple(a for t in found for a in atoms(declared(t)[key]))

    def attribute(self, node: ast.Attribute, types: tuple) -> tuple:
        """``x.name`` on an instance of a flash_recipe class (Context): a field or a property's return type."""
        out: tuple = ()
        for cls in types:
            if not isinstance(cls, type) or is_typeddict(cls) or not cls.__module__.startswith("flash_recipe"):
                continue
            fields = typing.get_type_hints(cls)
            member = inspect.getattr_static(cls, node.attr, _MISSING)
            if node.attr in fields:
                out += atoms(fields[node.attr])
            elif isinstance(member, property):
                out += self.returns(member.fget)
            elif member is _MISSING:
                self.report(node, f"{cls.__name__} has no attribute {node.attr!r}")
        return out

    @staticmethod
    def element(types: tuple, of_dict: bool = False) -> tuple:
        """What iterating or indexing a ``list[X]`` gives (X), or looking up a ``dict[K, V]`` (V)."""
        out: tuple = ()
        for tp in types:
            args = typing.get_args(tp)
            if typing.get_origin(tp) is list and args:
                out += atoms(args[0])
            elif typing.get_origin(tp) is dict and len(args) == 2 and of_dict:
                out += atoms(args[1])
        return out

    def type_of(self, node: ast.expr, env: dict[str, tuple]) -> tuple:
        if isinstance(node, ast.Name):
            return env.get(node.id, ())
        if isinstance(node, ast.Attribute):
            return self.attribute(node, self.type_of(node.value, env))
        if isinstance(node, ast.Subscript):
            value = self.type_of(node.value, env)
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                return self.key(node, value, node.slice.value)
            return self.element(value, of_dict=True)
        if isinstance(node, ast.BoolOp):
            return tuple(a for value in node.values for a in self.type_of(value, env))
        if isinstance(node, ast.IfExp):
            return self.type_of(node.body, env) + self.type_of(node.orelse, env)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and node.args:
                value = self.type_of(func.value, env)
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    return self.key(node, value, first.value)
                return self.element(value, of_dict=True)
            if isinstance(func, ast.Name) and func.id == "cast" and node.args:
                return self.annotation(node.args[0])
            if isinstance(func, ast.Name) and callable(self.namespace.get(func.id)):
                return self.returns(self.namespace[func.id])
        return ()

    def bind(self, node: ast.AST, env: dict[str, tuple]) -> None:
        """Record the type of a variable that ``node`` assigns (or a loop binds)."""
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            pairs = [(node.targets[0], node.value)]
            if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(node.targets[0].elts, node.value.elts))
            for target, value in pairs:
                if isinstance(target, ast.Name):
                    env[target.id] = self.type_of(value, env) or env.get(target.id, ())
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            env[node.target.id] = self.annotation(node.annotation)
        elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            env[node.target.id] = self.element(self.type_of(node.iter, env)) or env.get(node.target.id, ())

    def function(self, fn: ast.FunctionDef, owner: Optional[type] = None) -> None:
        """Infer the variables of ``fn`` (a method of ``owner`` when given), then check every key it uses."""
        self.function_name = fn.name
        arguments = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        env = {arg.arg: self.annotation(arg.annotation) for arg in arguments}
        if owner is not None and arguments:
            env[arguments[0].arg] = (owner,)
        nodes = list(ast.walk(fn))
        self.reporting = False
        for _ in range(3):  # a variable may be assigned from one that the walk reaches later
            for node in nodes:
                self.bind(node, env)
        self.reporting = True
        for node in nodes:
            if isinstance(node, (ast.Subscript, ast.Attribute, ast.Call)):
                self.type_of(node, env)
            elif (
                isinstance(node, ast.Compare)
                and isinstance(node.ops[0], (ast.In, ast.NotIn))
                and isinstance(node.left, ast.Constant)
                and isinstance(node.left.value, str)
            ):
                self.key(node, self.type_of(node.comparators[0], env), node.left.value)

    def check(self, source: str) -> KeyChecker:
        """Check each module-level function of ``source`` and each method of its classes."""
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                self.function(node)
            elif isinstance(node, ast.ClassDef) and isinstance(self.namespace.get(node.name), type):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        self.function(item, self.namespace[node.name])
        return self


def check_module(module: ModuleType) -> KeyChecker:
    return KeyChecker(vars(module)).check(inspect.getsource(module))


@pytest.mark.parametrize(
    "module", [findings, rules_build, rules_runtime, doctor, probes], ids=lambda m: m.__name__.rsplit(".", 1)[-1]
)
def test_every_key_read_on_the_facts_is_declared(module):
    checker = check_module(module)
    assert checker.problems == []


def test_the_checker_follows_the_rules_to_their_facts():
    """The keys are checked where rules read them: through ctx's properties, aliases, ``or {}``, a helper's return
    type and loops, down to nested TypedDicts."""
    checked = set().union(*(check_module(module).checked for module in rules.RULE_MODULES))
    expected = {
        ("TorchFacts", "cxx11abi"),
        ("TorchFacts", "import_error"),
        ("GpusFacts", "devices"),
        ("GpuDevice", "capability"),
        ("GpuDevice", "name"),
        ("EnvVarFacts", "MAX_JOBS"),
        ("NvccFacts", "path"),
        ("FlashAttnFacts", "wheel_name_parts"),
        ("WheelNameParts", "cxx11abi"),
        ("SdpaKernels", "FLASH_ATTENTION"),
        ("SdpaKernelResult", "warnings"),
        ("BackendsFacts", "explain"),
        ("NetworkFacts", "reachable"),
        ("ProjectFacts", "torch_index"),
        ("TorchIndex", "url"),
        ("WheelFileFacts", "metadata_version"),
        ("PlatformFacts", "mem_available_gib"),
        ("TritonFacts", "version"),
        ("BuildToolsFacts", "missing"),
    }
    assert expected <= checked, sorted(expected - checked)
    assert {"CompileCheck", "FlexFacts", "SdpaFacts"} <= {name for name, _ in check_module(doctor).checked}


MISSPELT_RULE = """
def _misspelt(ctx: Context, finding: Build) -> Optional[Finding]:
    torch = ctx.torch
    parts = ctx.flash_attn.get("wheel_name_parts") or {}
    if torch.get("verison") and parts["cxx11_abi"] and "MAX_JOB" in ctx.env and ctx.trch:
        return finding("t", "error", [d["capabilty"] for d in _old_gpus(ctx)], "upstream-flash-attn", "")
    return None
"""


def test_the_checker_reports_a_misspelt_key():
    """The same checker over a rule with misspelt keys (and a misspelt probe): each one is reported."""
    problems = KeyChecker(vars(rules_runtime)).check(MISSPELT_RULE).problems
    assert sorted(problem.split(": ", 1)[1] for problem in problems) == [
        "Context has no attribute 'trch'",
        "EnvVarFacts has no key 'MAX_JOB'",
        "GpuDevice has no key 'capabilty'",
        "TorchFacts has no key 'verison'",
        "WheelNameParts has no key 'cxx11_abi'",
    ]
    correct = MISSPELT_RULE
    for wrong, right in (
        ("verison", "version"),
        ("cxx11_abi", "cxx11abi"),
        ("MAX_JOB", "MAX_JOBS"),
        ("trch", "torch"),
        ("capabilty", "capability"),
    ):
        correct = correct.replace(wrong, right)
    assert KeyChecker(vars(rules)).check(correct).problems == []


# -- the declarations against the code -----------------------------------------------------------------------------
def test_facts_names_every_probe_and_context_reads_each():
    hints = typing.get_type_hints(facts.Facts)
    assert set(hints) == set(probes.PROBES) | {"project", "network", "release"}
    runners = dict(probes.PROBES, project=probe_project, network=probes.probe_network, release=release.probe_release)
    for name, tp in hints.items():
        probe_type, error = atoms(tp)
        assert error is facts.ProbeError
        assert typing.get_type_hints(runners[name])["return"] is probe_type, name
        if name != "project":  # the project's facts are Context.project, handed in by the doctor
            assert isinstance(inspect.getattr_static(rules.Context, name), property), name
            assert typing.get_type_hints(getattr(rules.Context, name).fget)["return"] is probe_type


def test_env_var_facts_declare_the_variables_the_probe_reads():
    assert set(declared(facts.EnvVarFacts)) == set(probes.BUILD_ENV_VARS)


def undeclared(value: Any, tp: Any, path: str = "") -> list[str]:
    """Where ``value`` does not fit ``tp``: a key its TypedDict does not declare, or a required key that is missing;
    nested TypedDicts (in lists, dicts and Optionals too) are checked the same way."""
    tds = [t for t in atoms(tp) if is_typeddict(t)]
    if isinstance(value, dict) and tds:
        fits = [t for t in tds if set(value) <= set(declared(t)) and t.__required_keys__ <= set(value)]
        if not fits:
            return [f"{path or '<top>'}: keys {sorted(value)} do not fit {' | '.join(t.__name__ for t in tds)}"]
        types = declared(fits[0])
        return [problem for key, item in value.items() for problem in undeclared(item, types[key], _join(path, key))]
    out = []
    for member in atoms(tp):
        args = typing.get_args(member)
        if typing.get_origin(member) is list and isinstance(value, list):
            out += [problem for i, item in enumerate(value) for problem in undeclared(item, args[0], f"{path}[{i}]")]
        elif typing.get_origin(member) is dict and isinstance(value, dict):
            out += [problem for key, item in value.items() for problem in undeclared(item, args[1], _join(path, key))]
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def test_undeclared_finds_extra_and_missing_keys():
    assert undeclared({"installed": False, "version": None, "cuda": "12.8"}, facts.TorchFacts) == []
    assert undeclared({"installed": False, "version": None, "cudaa": "12.8"}, facts.TorchFacts) != []
    assert undeclared({"version": None}, facts.TorchFacts) != []
    gpus = {
        "devices": [{"name": "T4", "capability": [7, 5], "shared_memory_per_block": 1, "smem": 1}],
        "driver": None,
        "driver_cuda": None,
        "source": None,
    }
    assert undeclared(gpus, facts.GpusFacts) == [
        "devices[0]: keys ['capability', 'name', 'shared_memory_per_block', 'smem'] do not fit GpuDevice"
    ]


def loopback_network_facts() -> list[dict]:
    """probe_network against a loopback server that answers, and against a port where nothing listens."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answered = probes.probe_network(f"http://127.0.0.1:{server.server_address[1]}/", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return [answered, probes.probe_network(f"http://127.0.0.1:{port}/", timeout=2)]


def test_the_probes_here_return_the_keys_their_types_declare(tmp_path):
    """Every probe on this machine for real, plus the probe paths a CPU machine can reach without a GPU."""
    found = dict(probes.collect())
    found["project"] = probe_project(str(tmp_path))
    hints = typing.get_type_hints(facts.Facts)
    problems = [problem for name, value in found.items() for problem in undeclared(value, hints[name], name)]
    for value in loopback_network_facts():
        problems += undeclared(value, facts.NetworkFacts, "network")
    for arch in ("sm130", "sm75", "gfx1"):  # no table of its own; too old; unknown
        problems += undeclared(probes.triton_compile_check(arch), facts.CompileCheck, f"compile {arch}")
    problems += undeclared(probes.sdpa_kernel_check("cpu"), facts.SdpaKernels, "sdpa_kernel_check")
    assert problems == []
    assert found["flash_attn"]["installed"] or set(found["flash_attn"]) == {"installed", "name", "module_location"}


@pytest.mark.slow
def test_a_compiled_check_returns_the_keys_its_type_declares():
    """triton_compile_check compiling for sm80 for real (no GPU needed; compiled, not interpreted: a subprocess
    without TRITON_INTERPRET), as test_doctor_probes runs it."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ENV_DIR.parents[1])
    code = "import json; from flash_recipe.env import probes; print(json.dumps(probes.triton_compile_check('sm80')))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["ok"] is True and undeclared(row, facts.CompileCheck) == [], row


def test_an_installed_flash_attn_returns_the_keys_its_type_declares(tmp_path, monkeypatch):
    """A fake flash-attn installed for real on a tmp sys.path (as in test_doctor_rules), wheel URL and all."""
    from test_doctor_rules import PUBLISHED_URL, make_flash_attn

    make_flash_attn(
        tmp_path,
        monkeypatch,
        cuda_module="raise ImportError('undefined symbol: x')\n",
        tag="cp311-cp311-linux_x86_64",
        direct_url=PUBLISHED_URL,
    )
    fa = probes.probe_flash_attn()
    assert fa["installed"] and fa["wheel_name_parts"] is not None and fa["loads"] is False
    assert undeclared(fa, facts.FlashAttnFacts) == []


def test_the_injected_facts_of_the_rule_tests_use_declared_keys():
    """The GPU facts test_doctor_rules injects (no GPU here) are spelt as the probes spell them; they may leave
    keys out."""
    from test_doctor_rules import T4, gpu_facts, turing_sdpa_probe

    hints = typing.get_type_hints(facts.Facts)
    for name, value in dict(gpu_facts(), gpus=T4, sdpa=turing_sdpa_probe()).items():
        (td,) = [t for t in atoms(hints[name]) if is_typeddict(t) and t is not facts.ProbeError]
        assert set(value) <= set(declared(td)), (name, sorted(set(value) - set(declared(td))))
        for key, item in value.items():
            assert undeclared(item, declared(td)[key], f"{name}.{key}") == []


# -- one definition of "the interpreter is on" ---------------------------------------------------------------------
def test_compile_check_asks_targets_whether_the_interpreter_is_on(monkeypatch):
    from flash_recipe.ops import targets

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(targets, "interpreter_enabled", lambda: True)
    row = probes.triton_compile_check("sm90")
    assert row["ok"] is None and "TRITON_INTERPRET" in row["error"]


def test_env_package_does_not_parse_triton_interpret_itself():
    """No ``os.environ.get("TRITON_INTERPRET")`` (or ``[...]``, ``"..." in``) in flash_recipe/env: it asks targets."""
    for path in ENV_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "TRITON_INTERPRET":
                raise AssertionError(f"{path.name}:{node.lineno} reads TRITON_INTERPRET itself")


# -- each rule's name is written once ----------------------------------------------------------------------------
def test_rule_names_come_from_the_registration(monkeypatch):
    monkeypatch.setattr(findings, "RULES", [])

    @rules.rule("toy-rule")
    def _toy(ctx, finding):
        return finding("a toy", "info", ["seen"], "upstream-flash-attn", "true", note="n")

    ((name, check),) = findings.RULES
    found = check(rules.Context(facts={}))
    assert name == "toy-rule" and found.rule == "toy-rule"
    assert found.to_dict() == {
        "rule": "toy-rule",
        "title": "a toy",
        "severity": "info",
        "evidence": ["seen"],
        "recipe": "upstream-flash-attn",
        "command": "true",
        "failure": None,
        "note": "n",
    }


def test_no_rule_spells_its_name_twice():
    """Rules build findings with the ``finding`` their registration hands them; only evaluate() constructs a
    Finding itself, for the rule that raised."""
    names = [name for name, _ in rules.RULES]
    assert len(names) == len(set(names))
    tree = ast.parse("".join(inspect.getsource(module) for module in (findings, *rules.RULE_MODULES)))
    constructors = sorted(
        {
            fn.name
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef)
            for node in ast.walk(fn)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding"
        }
    )
    assert constructors == ["evaluate"]
