"""Run one install path in a fresh, hermetic environment and check what it produced.

The orchestration only: the workspace (``workspace``) and the servers (``servers``) are set up,
the public hosts the recipe names are answered by those servers (``public_hosts``), the harness
makes what the path is given (a Poetry project, a project pinning torch), the recipe runs, the
checks (``checks``) look at the result, and their findings make up the path's result row, which
``report`` reads.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from recipes.harness import checks, public_hosts
from recipes.harness.checks import Check
from recipes.harness.config import REPO_ROOT, Options
from recipes.harness.paths import RecipePath
from recipes.harness.prepare import Build, Tools, Wheelhouse, interpreter_version, log
from recipes.harness.servers import PackageIndex, StaticServer, Tripwire
from recipes.harness.workspace import (
    StepFailed,
    Workspace,
    dir_size_mb,
    path_environment,
    prepare_given,
    run_step,
    workroot,
)


@dataclass
class Context:
    """What the paths of one run share."""

    options: Options
    tools: Tools
    build: Build
    wheelhouse: Wheelhouse
    run_dir: Path

    @property
    def python_version(self) -> str:
        return interpreter_version(self.options.python)


def new_row(path: RecipePath, log_file: Path, workdir: Path | None) -> dict:
    """The result row of ``path`` before anything ran: every field ``report`` reads, unset."""
    return {
        "path": path.id,
        "tool": path.tool,
        "tool_version": None,
        "summary": path.summary,
        "install_s": None,
        "verify_s": None,
        "env_mb": None,
        "torch": None,
        "triton": None,
        "backends": [],
        "backend": None,
        "passed": False,
        "fingerprint": None,
        "checks": [],
        "error": None,
        "log": str(log_file),
        "workdir": str(workdir) if workdir is not None else None,
        "workdir_mb": None,
    }


def run_path(ctx: Context, path: RecipePath) -> dict:
    """Run ``path`` and return its result row (see ``report``)."""
    options, build = ctx.options, ctx.build
    logs = ctx.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / f"{path.id}.log"
    log_file.write_text("")
    workspace = Workspace(workroot(), ctx.run_dir.name, path.id)
    row = new_row(path, log_file, workspace.dir if options.keep else None)
    found: list[Check] = []
    tripwire = Tripwire()
    base_packages = checks.interpreter_packages(options.python)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(tripwire)
            main_dirs = [ctx.wheelhouse.deps_dir, build.root / "dist"]
            if not path.torch_from_torch_index:
                main_dirs.append(ctx.wheelhouse.torch_dir)
            server = ctx.tools.exe("pypi-server")
            index = stack.enter_context(PackageIndex(server, main_dirs, logs / f"{path.id}.index.log", "index"))
            torch_index = stack.enter_context(
                PackageIndex(server, [ctx.wheelhouse.torch_dir], logs / f"{path.id}.torch-index.log", "torch-index")
            )
            git_root = stack.enter_context(StaticServer(build.git_root)).url()
            trusted = tripwire.stand_in(
                public_hosts.routes(index_url=index.url, torch_index_url=torch_index.url, git_root_url=git_root)
            )
            workspace.place_project(build, path)
            workspace.trust(trusted["GIT_SSL_CAINFO"])
            env = path_environment(
                dict(os.environ),
                home=workspace.home,
                tools=ctx.tools,
                python=options.python,
                python_bin=workspace.python_bin(options.python),
                extra={**tripwire.environment(), **trusted},
            )
            project, neutral = workspace.project, workspace.neutral

            started = time.monotonic()
            prepare_given(
                path,
                project,
                env=env,
                log_file=log_file,
                index_url=index.url,
                python_version=ctx.python_version,
                torch_version=options.torch_version,
            )
            if path.relock:
                found += checks.hermetic_lock(
                    project, env=env, log_file=log_file, index_url=index.url, python_version=ctx.python_version
                )
            log(f"{path.id}: running recipe.sh")
            # The recipe as the build under test has it (the working tree may have moved on).
            script = build.checkout / path.script.relative_to(REPO_ROOT)
            run_step(["bash", script], cwd=project, env=env, log_file=log_file)
            row["install_s"] = round(time.monotonic() - started, 1)
            log(f"{path.id}: installed in {row['install_s']} s")

            env_dir = project / ".venv"
            env_python = env_dir / "bin" / "python"
            row["tool_version"] = checks.tool_version(path, env, env_python, project)
            found.append(checks.check_environment(env_dir))

            probe = checks.probe_install(env_python, env=env, cwd=neutral, log_file=log_file)
            (torch_wheel,) = ctx.wheelhouse.torch_dir.glob("torch-*.whl")
            installed = checks.check_install(
                probe,
                path,
                build=build,
                torch_version=options.torch_version,
                torch_wheel=torch_wheel,
            )
            row.update(torch=installed.torch, triton=installed.triton)
            found += installed.checks

            run = checks.run_verify(
                env_dir, env=env, cwd=neutral, log_file=log_file, interpret=checks.triton_interpret(options)
            )
            row["verify_s"] = run.seconds
            verified = checks.check_verify(run, path, build.version)
            row.update(fingerprint=verified.fingerprint, backends=verified.backends, backend=verified.backend)
            found += verified.checks

            row["env_mb"] = dir_size_mb(env_dir)
    except StepFailed as exc:
        row["error"] = str(exc)
    except Exception as exc:  # one path's failure must not stop the others
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            row["workdir_mb"] = workspace.size_mb()  # environment, project and tool caches
        workspace.release(keep=options.keep)
    # Also when the recipe failed: a refused download is the likeliest reason.
    found.append(checks.check_network(tripwire.attempts))
    found.append(checks.check_interpreter_untouched(base_packages, checks.interpreter_packages(options.python)))
    row["checks"] = [c.__dict__ for c in found]
    row["passed"] = row["error"] is None and bool(found) and all(c.ok for c in found)
    return row
