"""What ``is_causal``, ``alignment``, ``window``, a padding mask and GQA do to the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._api.forward import scaled_dot_product_attention
from ..testing.backends import Backend
from ._plumbing import configured, host, normal

__all__ = ["WeightsPanel", "attention_patterns"]


@dataclass(frozen=True)
class WeightsPanel:
    """Attention weights of one call, for a heatmap.

    Made by :func:`attention_patterns`; each parameter is the field of the same name.

    Parameters
    ----------
    title : str
        What the panel shows.
    call : str
        The keyword arguments passed to :func:`sdpa_array.scaled_dot_product_attention`.
    weights : numpy.ndarray, shape (L, S) or (H, L, S)
        The returned weights (exact zeros where a key is excluded).
    """

    title: str
    call: str
    weights: np.ndarray


def attention_patterns(
    *, backend: Backend | str = "numpy", dtype: str = "float64", seed: int = 0
) -> tuple[WeightsPanel, ...]:
    """Weights of one random problem under each masking option of the library.

    Parameters
    ----------
    backend : Backend or str, default "numpy"
        Where the inputs are placed and attention runs: a backend or its id in
        :data:`sdpa_array.testing.backends.BACKENDS`.
    dtype : str, default "float64"
        Floating dtype on the backend.
    seed : int, default 0
        Seed of the NumPy generator.

    Returns
    -------
    tuple of WeightsPanel
        In order: causal (``L = S = 8``); causal with ``L = 4, S = 8`` under
        ``alignment="top_left"`` and ``"bottom_right"``; ``window=(2, 1)``; causal with
        ``window=(2, 0)`` (sliding-window decoding); a padding mask hiding the last 3 of 8
        keys; and grouped-query attention with 4 query heads sharing 2 key/value heads
        (weights of shape ``(4, 8, 8)``: every query head gets the same queries, so heads
        0–1 and heads 2–3 show identical weights).
    """

    b = configured(backend)
    rng = np.random.default_rng(seed)
    E = 4

    def run(L: int, S: int, heads_kv: int = 0, heads_q: int = 0, **kwargs: Any) -> np.ndarray:
        q_shape = (heads_q, L, E) if heads_q else (L, E)
        kv_shape = (heads_kv, S, E) if heads_kv else (S, E)
        q = rng.standard_normal((L, E)) * 1.5
        q = b.asarray(np.broadcast_to(q, q_shape).copy(), dtype)
        k = normal(b, rng, kv_shape, dtype)
        v = normal(b, rng, (*kv_shape[:-1], 1), dtype)
        _, weights = scaled_dot_product_attention(q, k, v, return_weights=True, **kwargs)
        return host(weights)

    padding = b.asarray((np.arange(8) < 5)[None, :], "bool")
    return (
        WeightsPanel("causal, L = S = 8", "is_causal=True", run(8, 8, is_causal=True)),
        WeightsPanel(
            "causal, L = 4, S = 8, top_left",
            "is_causal=True, alignment='top_left'",
            run(4, 8, is_causal=True, alignment="top_left"),
        ),
        WeightsPanel(
            "causal, L = 4, S = 8, bottom_right",
            "is_causal=True, alignment='bottom_right'",
            run(4, 8, is_causal=True, alignment="bottom_right"),
        ),
        WeightsPanel("window (2, 1)", "window=(2, 1)", run(8, 8, window=(2, 1))),
        WeightsPanel(
            "causal sliding window (2, 0)",
            "is_causal=True, window=(2, 0)",
            run(8, 8, is_causal=True, window=(2, 0)),
        ),
        WeightsPanel(
            "padding mask: keys 5-7 are padding",
            "mask=arange(8)[None, :] < 5  (shape (1, 8), broadcast over queries)",
            run(8, 8, mask=padding),
        ),
        WeightsPanel(
            "GQA: 4 query heads, 2 key/value heads",
            "enable_gqa=True, query (4, 8, E), key/value (2, 8, E)",
            run(8, 8, heads_kv=2, heads_q=4, enable_gqa=True),
        ),
    )
