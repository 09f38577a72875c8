"""Triton kernels: ``forward`` and ``backward`` (jit kernels and their launchers), ``attention``
(the torch custom ops and autograd), ``configs`` (launch configurations as data).

Importing ``flash_recipe.ops`` imports Triton; ``flash_recipe`` itself imports it only when the
``triton`` backend first runs.
"""
