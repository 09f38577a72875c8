"""The sizes of one attention problem, which every tool's case type extends.

``Sizes`` holds what a call's tensors measure: q ``(batch, seqlen_q, nheads, head_dim)``, k and v
``(batch, seqlen_k, nheads_k, head_dim)``; query head ``h`` reads kv head ``h // (nheads //
nheads_k)``. For a KV cache ``seqlen_k`` is the cache's capacity, the rows each batch entry can
hold. The tools' cases add what their call takes on top (``verify.Case``: the score options;
``verify_kvcache.KVCase``: the cache's contents; ``bench.Shape``: a dtype; ``tune.problem.Shape``:
the filled lengths; the GPU check's ``Case``: the kind of call), as dataclass fields after these
six, so a case is written ``Case(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, ...)``.

Nothing here imports torch: case tables stay plain data.
"""

from __future__ import annotations

import dataclasses

SIZE_FIELDS = ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "head_dim")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """q ``(batch, seqlen_q, nheads, head_dim)``; k, v ``(batch, seqlen_k, nheads_k, head_dim)``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < (0 if name == "seqlen_k" else 1):
                raise ValueError(f"{name} must be at least {0 if name == 'seqlen_k' else 1}, got {value}")
        if self.nheads % self.nheads_k:
            raise ValueError(
                f"nheads ({self.nheads}) must be a multiple of nheads_k ({self.nheads_k}): each kv head serves "
                "a whole group of query heads"
            )

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.nheads // self.nheads_k

    @property
    def heads(self) -> str:
        """``"MHA"`` (one query head per kv head), ``"MQA"`` (one kv head) or ``"GQA"``."""
        return "MHA" if self.group == 1 else "MQA" if self.nheads_k == 1 else "GQA"

    @property
    def sizes_id(self) -> str:
        """``B2-Sq113-Sk203-H8-Hk2-D64``: the six sizes, as the cases' ids begin (or contain) them."""
        return f"B{self.batch}-Sq{self.seqlen_q}-Sk{self.seqlen_k}-H{self.nheads}-Hk{self.nheads_k}-D{self.head_dim}"

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.nheads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_k, self.nheads_k, self.head_dim)

    def sizes(self) -> dict:
        """The six sizes by name: ``Case(**shape.sizes(), causal=True)`` is a case of another type
        on the same sizes."""
        return {name: getattr(self, name) for name in SIZE_FIELDS}

    def forward_flops(self, causal: bool) -> float:
        """Matrix FLOPs of the forward: ``4 * batch * nheads * seqlen_q * seqlen_k * head_dim`` (Q.K^T
        and P.V, two FLOPs a multiply-add), halved when causal (about half the pairs are masked)."""
        full = 4.0 * self.batch * self.nheads * self.seqlen_q * self.seqlen_k * self.head_dim
        return full * (0.5 if causal else 1.0)
