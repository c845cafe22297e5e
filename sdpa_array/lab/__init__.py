"""Claims about attention (derived on the docs' Theory page), as experiments on any backend.

Each experiment is an Array-API function: it draws its random inputs with NumPy
(``np.random.default_rng(seed)``; the Array API has no random numbers), moves them to the
chosen backend from :mod:`sdpa_array.testing.backends`, does the arithmetic there, and
returns a small frozen dataclass of host (NumPy) summaries. The experiments do not plot:
the ``table_*`` functions turn a result into text and the ``draw_*`` functions draw it on a
matplotlib figure, for ``python -m sdpa_array experiments`` and the documentation's gallery.

========================================  ==============================================
experiment                                claim checked
========================================  ==============================================
:func:`dot_product_variance`              ``Var(q·k) = E``, and 1 after ``/ sqrt(E)``
:func:`softmax_saturation`                large logits make softmax one-hot and its
                                          Jacobian ``diag(p) - p pᵀ`` vanish
:func:`gradient_flow`                     the gradient reaching ``Q`` collapses with
                                          scale 1, shrinks with ``1/E``, and stays put
                                          with ``1/sqrt(E)``
:func:`additive_attention`,               the cost of additive (Bahdanau) attention, and
:func:`attention_cost`                    how much of the quoted ``O(n² d²)`` is avoidable
:func:`query_key_asymmetry`               ``softmax(S) != softmax(Sᵀ)ᵀ`` and
                                          ``dL/dQ = dS K`` differs from ``dL/dK = dSᵀ Q``
:func:`worked_example`                    the Theory page's worked example, exactly, and which
                                          published rounded figures are wrong
:func:`attention_patterns`                what ``is_causal``, ``alignment``, ``window``,
                                          GQA and a padding mask do to the weights
========================================  ==============================================

Every name is importable from :mod:`sdpa_array.lab` itself; the submodules group them:
``softmax_and_jacobian``, ``backward`` (the VJP from the chain rule), ``scaling`` (variance,
saturation, gradient flow), ``cost`` (additive against dot-product attention),
``asymmetry``, ``numerical_example`` (the worked example), ``patterns``, and ``tables`` and
``figures`` (text and pictures of the results).

Examples
--------
>>> from sdpa_array import lab
>>> r = lab.dot_product_variance(d_ks=(16, 256), n_samples=2048)
>>> bool(abs(r.scaled_variance[1] - 1.0) < 3.3 * r.scaled_variance_stderr[1])
True
>>> print(lab.table_variance(r).splitlines()[0])  # doctest: +ELLIPSIS
E    mean q·k  var q·k  99.9% interval (theory E)  ...
"""

from __future__ import annotations

# Names the single-module ``sdpa_array.lab`` also exposed; kept so that they still resolve.
from .._api.forward import scaled_dot_product_attention as scaled_dot_product_attention
from .._api.vjp import scaled_dot_product_attention_vjp as scaled_dot_product_attention_vjp
from .._arrays.compat import array_namespace as array_namespace
from .._arrays.compat import device as device
from ..reference import to_numpy as to_numpy
from ..testing.backends import Backend as Backend
from ..testing.backends import get_backend as get_backend
from .asymmetry import QueryKeyAsymmetry, query_key_asymmetry
from .backward import attention_vjp, attention_vjp_from_derivation
from .cost import (
    AttentionCost,
    FlopCount,
    additive_attention,
    additive_attention_flops,
    attention_cost,
    dot_product_attention_flops,
)
from .figures import (
    draw_asymmetry,
    draw_cost,
    draw_gradient_flow,
    draw_patterns,
    draw_saturation,
    draw_variance,
    draw_worked_example,
)
from .numerical_example import (
    EXAMPLE_KEY,
    EXAMPLE_QUERY,
    EXAMPLE_VALUE,
    PUBLISHED,
    PublishedFigure,
    WorkedExample,
    worked_example,
)
from .patterns import WeightsPanel, attention_patterns
from .scaling import (
    D_KS,
    SCALES,
    VARIANCES,
    DotProductVariance,
    GradientFlow,
    SoftmaxSaturation,
    dot_product_variance,
    gradient_flow,
    softmax_saturation,
)
from .softmax_and_jacobian import softmax, softmax_jacobian
from .tables import (
    format_table,
    pattern_text,
    table_asymmetry,
    table_cost,
    table_gradient_flow,
    table_patterns,
    table_saturation,
    table_variance,
    table_worked_example,
)

__all__ = [
    "D_KS",
    "EXAMPLE_KEY",
    "EXAMPLE_QUERY",
    "EXAMPLE_VALUE",
    "PUBLISHED",
    "SCALES",
    "VARIANCES",
    "AttentionCost",
    "DotProductVariance",
    "FlopCount",
    "GradientFlow",
    "PublishedFigure",
    "QueryKeyAsymmetry",
    "SoftmaxSaturation",
    "WeightsPanel",
    "WorkedExample",
    "additive_attention",
    "additive_attention_flops",
    "attention_cost",
    "attention_patterns",
    "attention_vjp",
    "attention_vjp_from_derivation",
    "dot_product_attention_flops",
    "dot_product_variance",
    "draw_asymmetry",
    "draw_cost",
    "draw_gradient_flow",
    "draw_patterns",
    "draw_saturation",
    "draw_variance",
    "draw_worked_example",
    "format_table",
    "gradient_flow",
    "pattern_text",
    "query_key_asymmetry",
    "softmax",
    "softmax_jacobian",
    "softmax_saturation",
    "table_asymmetry",
    "table_cost",
    "table_gradient_flow",
    "table_patterns",
    "table_saturation",
    "table_variance",
    "table_worked_example",
    "worked_example",
]
