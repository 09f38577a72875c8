"""Triton kernels, one module per algorithm, each with jit kernels and launcher functions:

- ``forward``: attention forward (online softmax) and the split-KV merge;
- ``launch``: what the launchers share: ``ScoreOptions``, ``Varlen``, ``KeyRanges`` and the keyword
  arguments they become;
- ``backward``: the recomputing backward (preprocess, dK/dV, dQ);
- ``kvcache``: rotary embedding and in-place cache append, then the forward over the cache;
- ``splits``: the split-KV rule (how many shares of the keys a launch over a cache splits into);
- ``dropout``: the dropout mask materialised for ``return_attn_probs``;
- ``tiles``: the Triton helpers they share (tile loads, loop bounds, logits, dropout draws);
- ``attention``: the torch custom ops with fake kernels and autograd;
- ``configs``: launch configurations per architecture, as data (and the one lookup launchers use);
- ``tuned``: the per-GPU cache of tuned configurations that ``flash-recipe tune`` writes;
- ``features``: where the kernels use compiler features such as TMA tensor descriptors.

The offline compile of every variant for GPU targets is a tool: ``flash_recipe.tools.compile_check``.

Importing a kernel module (``forward``, ``backward``, ``kvcache``, ``dropout``, ``tiles``,
``attention``) imports Triton; ``configs``, ``tuned``, ``features`` and ``splits`` do not.
``flash_recipe`` itself imports Triton only when the ``triton`` backend first runs.
"""
