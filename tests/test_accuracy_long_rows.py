"""float32 error of the NumPy kernels on long rows, forward and gradients, against torch's.

Unit logits, rows of 128 to 1024 keys: the relative RMS error ``‖x - oracle‖ / ‖oracle‖`` of
the output and of ``dq, dk, dv``, pooled over :data:`SEEDS` draws, must be at most
:data:`BOUND` times that of the better of torch's two CPU kernels (its default and
``SDPBackend.MATH``) on the same rounded inputs. The gap this pins (1.12-1.39x before) was
the length of the contractions of ``P V``, ``Pᵀ dO``, ``dS K`` and ``dSᵀ Q``: OpenBLAS
accumulates each output element in one chain along them, and ``_arrays/products.py`` now
splits them into chunks of 128, or of 64 where the whole sum is at most 128 long (1.23 for
the gradients at L = 128 causal before).

Why this bound and these cases: at unit logits the pooled ratio repeats to about 1 %
between pools of 3 seeds (``asv_benchmarks/studies/accuracy_gaps.py``), so :data:`BOUND` = 1.05 is
the issue's target with room for that noise only; measured 0.88-1.02 here (rows of 256 to
1024). Max-abs errors
and large logits are left out: there a few rows (near ties of the two largest scores) carry
the whole error and two equally accurate kernels differ by 0.7-2x between pools; the
forward at large logits is checked against torch's default kernel in
``test_accuracy_vs_torch.py``.

The gradients' float64 reference is the chain rule written out here from the oracle's
weights (the oracle's own VJP forms an ``(L, S, S)`` Jacobian, too large at L = 1024).
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference

torch = pytest.importorskip("torch")

#: Allowed ratio of our pooled relative RMS error to the better of torch's two kernels.
BOUND = 1.05
#: Draws pooled per case.
SEEDS = 3
#: ``name: ((B, H, L, S, E), options)``; ``"bias"`` draws a standard normal ``(L, S)`` bias.
CASES = {
    "L1024-E64": ((1, 2, 1024, 1024, 64), {}),
    "L1024-E64-causal": ((1, 2, 1024, 1024, 64), {"is_causal": True}),
    "L1024-E64-bias": ((1, 2, 1024, 1024, 64), {"bias": True}),
    "L256-E48-bias": ((1, 2, 256, 256, 48), {"bias": True}),
    "L128-E64-causal": ((1, 4, 128, 128, 64), {"is_causal": True}),
}
OUTPUTS = ("out", "dq", "dk", "dv")


def _draw(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _oracle(q, k, v, grad, options) -> list[np.ndarray]:
    """Output and ``dq, dk, dv`` in float64: ``dZ = P * (dP - rowsum(P * dP))``."""
    q, k, v, grad = (a.astype(np.float64) for a in (q, k, v, grad))
    options = {n: (a.astype(np.float64) if n == "bias" else a) for n, a in options.items()}
    out, weights = reference.scaled_dot_product_attention(q, k, v, return_weights=True, **options)
    scale = 1.0 / np.sqrt(q.shape[-1])
    d_weights = grad @ np.swapaxes(v, -1, -2)
    dz = weights * (d_weights - np.sum(weights * d_weights, axis=-1, keepdims=True))
    dq = scale * dz @ k
    dk = scale * np.swapaxes(dz, -1, -2) @ q
    return [out, dq, dk, np.swapaxes(weights, -1, -2) @ grad]


def _torch(q, k, v, grad, options, kernel) -> list[np.ndarray]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
    keywords = {"is_causal": options.get("is_causal", False)}
    if "bias" in options:
        keywords["attn_mask"] = torch.from_numpy(options["bias"])
    if kernel == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **keywords)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **keywords)
    out.backward(torch.from_numpy(grad))
    return [t.detach().numpy() for t in (out, tq.grad, tk.grad, tv.grad)]


def _ours(q, k, v, grad, options, implementation) -> list[np.ndarray]:
    out = sdpa_array.scaled_dot_product_attention(q, k, v, implementation=implementation, **options)
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, v, grad, implementation=implementation, **options
    )
    return [out, *grads[:3]]


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
@pytest.mark.parametrize("name", list(CASES))
def test_relative_rms_error_at_most_torch(name: str, implementation: str) -> None:
    (B, H, L, S, E), spec = CASES[name]
    squared = {who: np.zeros(4) for who in ("ours", "default", "math")}
    norms = np.zeros(4)
    for seed in range(SEEDS):
        rng = np.random.default_rng([seed, L, E])
        q, k, v, grad = (
            _draw(rng, s) for s in [(B, H, L, E), (B, H, S, E), (B, H, S, E), (B, H, L, E)]
        )
        options: dict = {"is_causal": True} if spec.get("is_causal") else {}
        if spec.get("bias"):
            options["bias"] = _draw(rng, (L, S))
        want = _oracle(q, k, v, grad, options)
        got = {
            "ours": _ours(q, k, v, grad, options, implementation),
            "default": _torch(q, k, v, grad, options, "default"),
            "math": _torch(q, k, v, grad, options, "math"),
        }
        for who, arrays in got.items():
            squared[who] += [
                np.sum((x.astype(np.float64) - w) ** 2) for x, w in zip(arrays, want, strict=True)
            ]
        norms += [np.sum(w**2) for w in want]
    rms = {who: np.sqrt(s / norms) for who, s in squared.items()}
    ratio = rms["ours"] / np.minimum(rms["default"], rms["math"])
    assert np.all(ratio <= BOUND), dict(zip(OUTPUTS, ratio.round(3), strict=True))
