"""The user tools, on top of every other layer; each is a ``flash-recipe`` subcommand or a
``python -m flash_recipe.tools.<name>`` module:

- ``cli``: the ``flash-recipe`` command, which dispatches to the others (and to the doctor in
  ``flash_recipe.env``);
- ``verify``: every backend against the reference by the accuracy rule, with a fingerprint;
- ``bench``: throughput and memory against torch SDPA and other peers;
- ``tune``: launch configurations timed on the local GPU, the fastest kept per device;
- ``warmup``: the kernels compiled for the local GPU ahead of time;
- ``hub_build``: the Hub kernel copy of the package;
- ``host_cost``: the Python calls and microseconds one call spends on the host, by entry point.

Beside them, what the commands share: ``sizes`` (the problem sizes every tool's case type
extends), ``compile_calls`` (the launcher calls that compile the kernels for a GPU target without a
GPU, which ``tune`` prunes its candidates with), ``stub_driver`` (a stand-in CUDA driver under which
Triton's own launcher runs on CPU tensors), ``warmup_calls``, ``verify_kvcache``, ``bench_decode``
and ``bench_timing``.

The developer tools of a checkout (the GPU campaign, the compile check of every target, the GPU
correctness table, the reports behind the shipped tables) sit outside the wheel, in ``devtools/``.

Nothing below this package imports it, except the doctor's compile probe (``flash_recipe.env``,
which sits beside the tools).
"""
