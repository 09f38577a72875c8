"""The user tools, on top of every other layer; each is a ``flash-recipe`` subcommand or a
``python -m flash_recipe.tools.<name>`` module:

- ``cli``: the ``flash-recipe`` command, which dispatches to the others (and to the doctor in
  ``flash_recipe.env``);
- ``verify``: every backend against the reference by the accuracy rule, with a fingerprint;
- ``bench``: throughput and memory against torch SDPA and other peers;
- ``tune``: launch configurations timed on the local GPU, the fastest kept per device;
- ``campaign``: one command that runs the GPU checks and writes a report;
- ``warmup``: the kernels compiled for the local GPU ahead of time;
- ``compile_check``: every kernel compiled for every GPU target as a launch compiles it, no GPU needed.

Nothing below this package imports it, except the doctor's compile probe (``flash_recipe.env``,
which sits beside the tools).
"""
