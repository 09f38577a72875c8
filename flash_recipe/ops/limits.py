"""Numbers the public API, the launchers, the split-KV rule and the tuned cache share.

A leaf module: it imports nothing, so any module of the package can import it without a cycle.
"""

from __future__ import annotations

# The most shares of the keys a launch over a KV cache may split into: flash-attn's cap on
# ``num_splits``. The public API refuses a larger ``num_splits``, the split-KV rule never chooses
# more (``ops.splits``), and a tuned file may not hold more (``ops.tuned``).
MAX_SPLITS = 128

# The head dims the kernels are compiled for (a head dim is padded up to the next of these): the
# keys of the configuration table (``ops.configs``) and of a tuned file.
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256)

# The backward's paths: "one_pass" (the dK/dV kernel adds dQ to an fp32 workspace with atomic
# adds), "three_kernels" (preprocess, dQ kernel, dK/dV kernel; ``deterministic=True``) and
# "one_launch" (preprocess, then dK/dV and dQ programs in one launch, no atomics: a candidate where
# ``ops.configs.ONE_LAUNCH`` has its tiles). A family's default per head-dim bucket is
# ``ops.configs.BACKWARD_PATHS``; a tuned file may hold another for its GPU (``ops.tuned``).
BACKWARD_PATH_NAMES = ("one_pass", "three_kernels", "one_launch")
