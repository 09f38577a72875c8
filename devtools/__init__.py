"""The developers' tools of flash-recipe, run from a checkout and never shipped in the wheel.

- ``campaign``: the GPU campaign, one command that runs the checks, the benches, the shoot-out and
  the GPU tests on a lent GPU within its budget, and writes a report (``python -m devtools.campaign``);
- ``compile_check`` (with ``compiled_code``, the reader of the compiled code): every kernel
  compiled as a launch compiles it, for every GPU target, with no GPU;
- ``gpu_check`` (with ``gpu_check_cases``, its table): the campaign's correctness step;
- ``capture_check``: capture and replay under CUDA graphs;
- ``backward_paths``, ``schedule_report``, ``splits_report``: the reports behind the per-family
  tables of ``flash_recipe.ops``;
- ``warmup``: ``flash-recipe warmup`` with the campaign's steps.

They import ``flash_recipe`` (the installed package, or the checkout's when run from its root);
nothing in ``flash_recipe`` imports them (``pyproject.toml``'s import contracts).
"""
