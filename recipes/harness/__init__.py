"""The install matrix: every recipe in ``recipes/`` run end to end in a fresh environment.

Modules, in the order a run uses them:

- ``config``: options (torch index and version, cache and report locations);
- ``paths``: the install paths and what each must prove;
- ``prepare``: tools environment, project snapshot (sdist, wheel, bare git repository) and the
  wheelhouse, each built once and cached;
- ``servers``: pypiserver instances, the git HTTP server and the network tripwire, all on loopback;
- ``workspace``: one path's directory, its clean environment and the commands run in it;
- ``checks``: what a path installed, each check returning its findings;
- ``runner``: one path from start to result row: workspace, servers, recipe, checks;
- ``report``: the table (terminal, ``install-matrix.md``, ``install-matrix.json``).

Beside the matrix, ``reproduce`` holds the ``reproduce_upstream`` nox session's steps (two upstream
flash-attn install failures, reproduced and diagnosed): development tooling, kept out of the wheel.

Everything here uses the standard library plus ``packaging`` (a dependency of nox), so it runs in
nox's own interpreter. ``python -m recipes.harness --help`` shows the command line.
"""
