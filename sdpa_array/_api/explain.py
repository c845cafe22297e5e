"""``explain``: which implementation (and native kernel) a call runs, and why.

It validates the call exactly as :func:`~sdpa_array.scaled_dot_product_attention` does and
asks the dispatcher the same question, without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._arrays.typing import Array
from .._plan.plan import (
    BackwardTileSummary,
    TileSummary,
    backward_tiles_of,
    native_vjp_kernel,
    plan_forward,
    plan_vjp,
    tiles_of,
)
from .._problem.options import Options
from .._problem.outputs import Outputs
from .layout import check_layout, swap_heads_and_length

__all__ = ["Explanation", "explain"]


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found.

    Attributes
    ----------
    forward, vjp : str
        The implementation of the forward call and of
        :func:`~sdpa_array.scaled_dot_product_attention_vjp` with the same arguments
        (``"auto"`` resolved).
    forward_kernel, vjp_kernel : str or None
        The native kernel each delegates to (``None`` when not native).
    automatic : bool
        Whether ``implementation="auto"`` chose them.
    forward_why, vjp_why : tuple of str
        For an automatic choice, why each implementation ``"auto"`` prefers was passed over.
    forward_fused, vjp_fused : bool
        Whether each runs a fused GPU kernel in the inputs' dtype (the Triton kernels, or
        a native kernel on a GPU): its softmax is in base 2 and the probabilities and score
        gradients are rounded to the inputs' dtype before their products, as in
        FlashAttention. Its error bound has the ``base2`` and ``rounded_operands`` terms of
        :mod:`sdpa_array.testing.bounds`; the library's own generic kernels compute a
        half-precision call's products in float32.
    forward_tiles : TileSummary or None
        For a blocked forward: its block sizes and how many tiles of the score matrices it
        visits (full, or with a mask) and skips, with the share of the scores it computes
        (as FlexAttention's ``BlockMask`` prints its sparsity); ``None`` otherwise.
    vjp_tiles : BackwardTileSummary or None
        The same for a blocked VJP: its query rows per tile, its key tiles (runs of key
        grid blocks), the tiles it visits and the blocks it skips; ``None`` otherwise.

    Examples
    --------
    >>> import numpy as np
    >>> import sdpa_array
    >>> q = np.zeros((1, 4096, 64), dtype=np.float32)
    >>> e = sdpa_array.explain(q, q, q, is_causal=True)
    >>> e.forward, e.automatic
    ('blocked', True)
    """

    forward: str
    vjp: str
    forward_kernel: str | None
    vjp_kernel: str | None
    automatic: bool
    forward_why: tuple[str, ...]
    vjp_why: tuple[str, ...]
    forward_fused: bool = False
    vjp_fused: bool = False
    forward_tiles: TileSummary | None = None
    vjp_tiles: BackwardTileSummary | None = None

    def __str__(self) -> str:
        lines = []
        for what, name, kernel, why, tiles in (
            ("forward", self.forward, self.forward_kernel, self.forward_why, self.forward_tiles),
            ("vjp", self.vjp, self.vjp_kernel, self.vjp_why, self.vjp_tiles),
        ):
            lines.append(f"{what}: {name}" + (f" ({kernel})" if kernel else ""))
            if tiles is not None:
                lines.append(f"  {tiles}")
            lines.extend(f"  passed over: {reason}" for reason in why)
        return "\n".join(lines)


def explain(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    return_weights: bool = False,
    return_lse: bool = False,
    return_max_scores: bool = False,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    layout: str = "BHLE",
    **options: Any,
) -> Explanation:
    """Which implementation a call of :func:`~sdpa_array.scaled_dot_product_attention` (and
    of its VJP) runs, the native kernel it delegates to, and why ``"auto"`` passed over the
    implementations it prefers. Nothing is computed.

    Parameters
    ----------
    query, key, value : array
        As for :func:`~sdpa_array.scaled_dot_product_attention`.
    return_weights, return_lse, return_max_scores, implementation, block_q, block_k, layout
        As for :func:`~sdpa_array.scaled_dot_product_attention` (the VJP is explained with
        the same ``implementation`` where it has it, else ``"auto"``).
    **options
        The call's other keyword arguments (``mask``, ``bias``, ``is_causal``, ...).

    Returns
    -------
    Explanation
        Printable (``print(sdpa_array.explain(q, k, v))``).

    Raises
    ------
    TypeError, ValueError
        As the call itself would, before any work.

    Examples
    --------
    >>> import numpy as np
    >>> import sdpa_array
    >>> q = np.zeros((2, 8, 4))
    >>> print(sdpa_array.explain(q, q, q, is_causal=True))  # doctest: +ELLIPSIS
    forward: materialized
      passed over: implementation='native' has no kernel for numpy arrays; ...
    vjp: materialized
      passed over: native: the library's own backward kernels are used off a GPU
      passed over: triton: auto uses the Triton kernels on a GPU only
    """
    given = Options.of(options, where="explain")
    check_layout(layout, {"query": query, "key": key, "value": value})
    if layout == "BLHE":  # planned as the call runs: heads first
        query, key, value = swap_heads_and_length(query, key, value)
    outputs = Outputs.of(return_weights, return_lse, return_max_scores)
    blocks = (block_q, block_k)
    plan = plan_forward(query, key, value, given, outputs, implementation, blocks)
    p, x, forward = plan.problem, plan.inputs, plan.choice
    try:
        planned_vjp = plan_vjp(query, key, value, given, implementation, blocks, problem=p)
    except ValueError:  # an implementation the VJP lacks, or one that refuses it
        planned_vjp = plan_vjp(query, key, value, given, "auto", (None, None), problem=p)
    vjp = planned_vjp.choice
    return Explanation(
        forward=forward.name,
        vjp=vjp.name,
        forward_kernel=None if forward.planned is None else forward.planned[1].kernel,
        vjp_kernel=native_vjp_kernel(p, x) if vjp.name == "native" else None,
        automatic=forward.automatic,
        forward_why=forward.why,
        vjp_why=vjp.why,
        forward_fused=_fused(forward.name, p.on_gpu),
        vjp_fused=_fused(vjp.name, p.on_gpu),
        forward_tiles=tiles_of(plan),
        vjp_tiles=backward_tiles_of(planned_vjp),
    )


def _fused(name: str, on_gpu: bool) -> bool:
    """Whether implementation ``name`` runs a fused kernel in the inputs' dtype."""
    return name == "triton" or (name == "native" and on_gpu)
