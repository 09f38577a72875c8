"""Triton kernels, one module per algorithm, each with jit kernels and launcher functions:

- ``forward``: attention forward (online softmax), split-KV included;
- ``options``: a call's options as the launchers take them (``ScoreOptions``, ``Varlen``,
  ``KeyRanges``); torch only;
- ``launch``: what the launchers share: ``score_args`` (the one function that turns ``ScoreOptions``
  into kernel arguments), the sizes and strides of a launch, and its ``Plan``, decided once per
  signature and launched by keyword; every kernel launch goes through it, on its tensors' device,
  its grid within CUDA's limits (a batch past 65535 folded into axis 0: ``fold_grid``);
- ``backward``: the recomputing backward's kernels (preprocess, dK/dV, dQ);
- ``backward_launch``: their launcher, ``attention_backward``, planned and launched as the forward;
- ``kvcache``: rotary embedding and in-place cache append, then the forward over the cache;
- ``split_merge``: split-KV's merge of the shares' partial outputs, which the forward launches after them;
- ``splits``: the split-KV rule (how many shares of the keys a launch over a cache splits into);
- ``packing``: whether a launch packs a GQA group into one query tile per kv head;
- ``schedule``: the order a launch's programs start in (``launch_order``, called inside the forward
  and dQ kernels) and how many heads a section of that order spans;
- ``dropout``: the dropout mask materialised for ``return_attn_probs``;
- ``tiles``: the Triton helpers they share (tile loads, loop bounds, logits, dropout draws);
- ``attention``: the torch custom ops with fake kernels and autograd, whose flat parameters come
  from one list (``OPTION_PARAMS``);
- ``configs``: launch configurations per architecture, as one table literal, and its lookup;
- ``targets``: the compile target of a device, the installed Triton release, the interpreter switch;
- ``choose``: the configuration a launch on a device takes (an override, a tuned entry or the
  table's), the fall back from a failing tuned one, and whether the one-pass backward runs;
- ``limits``: numbers shared across layers (``MAX_SPLITS``, ``HEAD_DIM_BUCKETS``); imports nothing;
- ``tuned``: the per-GPU cache of tuned configurations that ``flash-recipe tune`` writes;
- ``features``: where the kernels use compiler features such as TMA tensor descriptors;
- ``offline``: launches that compile for a named GPU target and run nothing, without that GPU.

The offline compile of every variant for GPU targets is a tool: ``devtools.compile_check``;
so are the reports of the split rule and the launch order (``devtools.splits_report``,
``devtools.schedule_report``).

Importing a kernel module (``forward``, ``backward``, ``kvcache``, ``split_merge``, ``dropout``, ``tiles``,
``attention``), ``backward_launch``, ``schedule``, ``launch`` or ``offline`` imports Triton; ``configs``, ``targets``,
``choose``, ``limits``, ``tuned``, ``features``, ``options``, ``splits`` and ``packing`` do not.
``flash_recipe`` itself imports Triton only when the ``triton`` backend first runs.
"""
