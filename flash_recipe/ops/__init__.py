"""Triton kernels, one module per algorithm, each with jit kernels and launcher functions:

- ``forward``: attention forward (online softmax) and the split-KV merge;
- ``launch``: what the launchers share: ``ScoreOptions``, ``Varlen``, ``KeyRanges`` and the keyword
  arguments they become;
- ``backward``: the recomputing backward (preprocess, dK/dV, dQ);
- ``kvcache``: rotary embedding and in-place cache append, then the forward over the cache;
- ``dropout``: the dropout mask materialised for ``return_attn_probs``;
- ``tiles``: the Triton helpers they share (tile loads, loop bounds, logits, dropout draws);
- ``attention``: the torch custom ops with fake kernels and autograd;
- ``configs``: launch configurations per architecture, as data;
- ``compile_check``: compile every variant for GPU targets without a GPU.

Importing ``flash_recipe.ops.<module>`` imports Triton; ``flash_recipe`` itself imports it only
when the ``triton`` backend first runs.
"""
