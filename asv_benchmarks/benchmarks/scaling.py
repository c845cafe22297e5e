"""Time against sequence length and against the share of admissible pairs, as ratios.

The performance page draws these figures (``docs/_ext/performance_figures.py``):

* :class:`TorchScaling`: our forward (``implementation="auto"``) over torch's
  ``scaled_dot_product_attention`` on the same memory, and our VJP
  (:func:`sdpa_array.scaled_dot_product_attention_vjp`) over torch's autograd backward of
  its own kernel, for ``L = S`` in :data:`LENGTHS`, ``B = 1``, ``H = 8``, ``E = 64``. On
  the CPU our inputs are NumPy float32 arrays and torch's the same memory
  (``torch.from_numpy``); on a CUDA GPU both are the same torch float16 tensors (skipped
  without one).
* :class:`DocumentSparsity`: :data:`DOCUMENT_COUNTS` documents of equal length packed in
  one sequence of :data:`PACKED_LENGTH` (NumPy float32), with
  ``mask_mod=sdpa_array.mods.document(doc, doc)`` and with ``segment_ids=(doc, doc)``,
  over the same call unmasked. A document mask keeps ``1 / n`` of the pairs: that is the
  ideal ratio.

Each ratio is the median of per-round ratios of the two calls timed interleaved in one
process (one untimed warm-up round, then :data:`~benchmarks.history.ROUNDS` rounds in a new
order each), so it moves much less from machine to machine than the times. **Lower is
better** throughout: ours / the peer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

import sdpa_array

from .history import ROUNDS, _inputs, _interleaved, _ratio, _threads

try:
    import torch
except ImportError:  # the figures against torch are then skipped
    torch = None

#: Sequence lengths ``L = S`` of the scaling figure.
LENGTHS = [256, 512, 1024, 2048, 4096]
#: ``(B, H, E)`` of every call.
BATCH, HEADS, HEAD_DIM = 1, 8, 64
#: Where the calls run: NumPy float32 on the CPU (torch CPU the peer), or torch float16
#: tensors on a CUDA GPU.
DEVICES = ["cpu-float32", "cuda-float16"]

#: Documents packed in one sequence of :data:`PACKED_LENGTH`.
DOCUMENT_COUNTS = [1, 2, 4, 8, 16]
PACKED_LENGTH = 2048


def _torch_backward(q: Any, k: Any, v: Any, g: Any) -> Callable[[], Any]:
    """torch's backward of its own kernel on tensors ``q, k, v`` (its graph built once)."""
    tq, tk, tv = (x.detach().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

    def run() -> Any:
        return torch.autograd.grad(out, (tq, tk, tv), g, retain_graph=True)

    return run


def _synchronized(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` followed by a wait for the GPU's queue, so that its time is the work's."""

    def run() -> Any:
        result = call()
        torch.cuda.synchronize()
        return result

    return run


class TorchScaling:
    """Our forward and VJP over torch's, as the sequence grows (lower is better)."""

    param_names: ClassVar = ["device", "length"]
    params: ClassVar = [DEVICES, LENGTHS]
    timeout = 900

    def setup(self, device: str, length: int) -> None:
        if torch is None:
            raise NotImplementedError("the peer is torch, which is not installed")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise NotImplementedError("no CUDA GPU")
        _threads()
        arrays = _inputs((BATCH, HEADS, length, HEAD_DIM), seed=length, count=4)
        if device == "cpu-float32":
            self.ours = arrays
            self.theirs = [torch.from_numpy(x) for x in arrays]
            self.wrap: Callable[[Callable[[], Any]], Callable[[], Any]] = lambda call: call
        else:
            tensors = [torch.from_numpy(x).to("cuda", torch.float16) for x in arrays]
            self.ours = self.theirs = tensors
            self.wrap = _synchronized

    def track_forward_ratio(self, device: str, length: int) -> float:
        """Our forward / torch's ``scaled_dot_product_attention`` on the same inputs."""
        q, k, v, _ = self.ours
        tq, tk, tv, _ = self.theirs
        sdpa = torch.nn.functional.scaled_dot_product_attention
        times = _interleaved(
            {
                "ours": self.wrap(lambda: sdpa_array.scaled_dot_product_attention(q, k, v)),
                "torch": self.wrap(lambda: sdpa(tq, tk, tv)),
            },
            ROUNDS,
        )
        return _ratio(times, "ours", "torch")

    track_forward_ratio.unit = "ratio"  # type: ignore[attr-defined]

    def track_backward_ratio(self, device: str, length: int) -> float:
        """Our VJP (which recomputes the scores) / torch's backward of its own forward."""
        q, k, v, g = self.ours
        vjp = sdpa_array.scaled_dot_product_attention_vjp
        times = _interleaved(
            {
                "ours": self.wrap(lambda: vjp(q, k, v, g)),
                "torch": self.wrap(_torch_backward(*self.theirs)),
            },
            ROUNDS,
        )
        return _ratio(times, "ours", "torch")

    track_backward_ratio.unit = "ratio"  # type: ignore[attr-defined]


class DocumentSparsity:
    """Packed documents through a mask function and through segment ids, over the same call
    unmasked (lower is better; ``1 / documents`` is the share of pairs computed)."""

    param_names: ClassVar = ["documents"]
    params: ClassVar = [DOCUMENT_COUNTS]
    timeout = 900

    def setup_cache(self) -> dict[int, dict[str, float]]:
        """Every count's two ratios, each from one interleaved run of its three calls."""
        _threads()
        f = sdpa_array.scaled_dot_product_attention
        q, k, v = _inputs((BATCH, HEADS, PACKED_LENGTH, HEAD_DIM), seed=PACKED_LENGTH)
        ratios = {}
        for documents in DOCUMENT_COUNTS:
            doc = np.repeat(np.arange(documents), PACKED_LENGTH // documents)
            mask_mod = sdpa_array.mods.document(doc, doc)
            times = _interleaved(
                {
                    "unmasked": lambda: f(q, k, v),
                    "mask_mod": lambda: f(q, k, v, mask_mod=mask_mod),  # noqa: B023
                    "segment_ids": lambda: f(q, k, v, segment_ids=(doc, doc)),  # noqa: B023
                },
                ROUNDS,
            )
            ratios[documents] = {
                name: _ratio(times, name, "unmasked") for name in ("mask_mod", "segment_ids")
            }
        return ratios

    def track_mask_mod_ratio(self, ratios: dict[int, dict[str, float]], documents: int) -> float:
        """``mask_mod=sdpa_array.mods.document(doc, doc)`` / the unmasked call."""
        return ratios[documents]["mask_mod"]

    track_mask_mod_ratio.unit = "ratio"  # type: ignore[attr-defined]

    def track_segment_ids_ratio(self, ratios: dict[int, dict[str, float]], documents: int) -> float:
        """``segment_ids=(doc, doc)`` / the unmasked call."""
        return ratios[documents]["segment_ids"]

    track_segment_ids_ratio.unit = "ratio"  # type: ignore[attr-defined]


#: The libraries whose versions :class:`Versions` records.
LIBRARIES = ["numpy", "torch", "sdpa_array"]


class Versions:
    """The versions of the libraries measured, recorded beside the figures: asv keeps no
    versions for a run in an existing environment (``--python=same``), and the performance
    page names them under each figure."""

    param_names: ClassVar = ["library"]
    params: ClassVar = [LIBRARIES]

    def track_version(self, library: str) -> int:
        """``major * 10000 + minor * 100 + patch`` of ``library``'s ``__version__``
        (2.13.0 is 21300)."""
        import importlib
        import re

        try:
            version = importlib.import_module(library).__version__
        except ImportError as exc:
            raise NotImplementedError(f"{library} is not installed") from exc
        major, minor, patch = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version).groups("0")
        return int(major) * 10000 + int(minor) * 100 + int(patch)

    track_version.unit = "version"  # type: ignore[attr-defined]
