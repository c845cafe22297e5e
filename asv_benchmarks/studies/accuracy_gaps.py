"""float32 error of our NumPy kernels against torch's CPU kernels, case by case.

For each case (shape ``(B, H, L, S, E)``; plain, ``is_causal``, a boolean mask or an
additive float bias; unit logits or large logits, q and k scaled by 31.6 so that the logits
are ~1e3) the float32 inputs are drawn in float64 and rounded once. On them this measures
the output and the gradients ``dq, dk, dv`` (for one float32 cotangent) of

* the float64 oracle :func:`sdpa_array.reference.scaled_dot_product_attention` and its
  ``_vjp`` (its explicit softmax Jacobian is ``(B, H, L, S, S)``: beyond ``--jacobian-mb``
  the gradients are the same chain rule in float64 from the oracle's weights,
  ``dZ = P * (dP - rowsum(P * dP))``);
* ours, ``implementation="materialized"`` and ``"blocked"``;
* torch's CPU kernel under its default backend selection and under ``SDPBackend.MATH``
  (gradients by autograd with the same cotangent);

each as the max abs error and the rel-RMS error ``||x - oracle|| / ||oracle||``, pooled
over the seeds (max of the max, RMS of the squares). One Markdown row per case and path;
ours also get the ratios ours / min(torch default, torch math) per metric (gradients: the
worst of dq, dk, dv). The last lines give the worst ratios and their cases.

Noise: the unit-logit rel-RMS ratios repeat to about 1% between 3-seed pools; max abs errors
(a maximum over few samples) and every large-logit ratio (a few near-tie rows carry the whole
error) do not: two equally accurate kernels differ by 0.7-2x between 3-seed pools there, so
the large-logit cases pool ``--large-seeds`` (12) draws. The ratio to the better of two torch
kernels is biased upwards too: the last lines give the same worst ratios for torch's own
default kernel. About 20 minutes on one thread::

    python asv_benchmarks/studies/accuracy_gaps.py --seeds 3
    python asv_benchmarks/studies/accuracy_gaps.py --quick   # L <= 256, one seed
"""

from __future__ import annotations

import argparse
import os
import platform

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sdpa_array
from sdpa_array import reference

SHAPES = [
    (1, 4, 128, 128, 64),
    (1, 4, 256, 256, 48),
    (1, 4, 1024, 1024, 64),
    (1, 2, 1024, 1024, 128),
]
VARIANTS = ("plain", "causal", "mask", "bias")
LARGE = 31.6  # q and k times this: logits ~ 1e3
NAMES = ("out", "dq", "dk", "dv")
PATHS = ("materialized", "blocked", "torch-default", "torch-math")


def draw(rng: np.random.Generator, shape: tuple[int, ...], factor: float = 1.0) -> np.ndarray:
    """Standard normal in float64, times ``factor``, rounded once to float32."""
    return (rng.standard_normal(shape) * factor).astype(np.float32)


def inputs(case: tuple, seed: int) -> dict:
    """The float32 arrays and options of one case for one seed."""
    (b, h, n_q, n_k, e), variant, large = case
    rng = np.random.default_rng([seed, n_q, e, VARIANTS.index(variant), int(large)])
    f = LARGE if large else 1.0
    x = {
        "q": draw(rng, (b, h, n_q, e), f),
        "k": draw(rng, (b, h, n_k, e), f),
        "v": draw(rng, (b, h, n_k, e)),
        "do": draw(rng, (b, h, n_q, e)),
        "opts": {},
    }
    if variant == "causal":
        x["opts"]["is_causal"] = True
    elif variant == "mask":
        mask = rng.random((n_q, n_k)) < 0.5
        mask[np.arange(n_q), np.arange(n_q) % n_k] = True  # every row keeps a key
        x["opts"]["mask"] = mask
    elif variant == "bias":
        x["opts"]["bias"] = draw(rng, (n_q, n_k))
    return x


def oracle(x: dict, jacobian_mb: float) -> list[np.ndarray]:
    """Float64 output and ``dq, dk, dv``."""
    q, k, v, do = (x[n].astype(np.float64) for n in ("q", "k", "v", "do"))
    opts = x["opts"]
    out, p = reference.scaled_dot_product_attention(q, k, v, return_weights=True, **opts)
    if p.size * p.shape[-1] * 8 / 2**20 <= jacobian_mb:
        grads = reference.scaled_dot_product_attention_vjp(q, k, v, do, **opts)[:3]
        return [out, *grads]
    scale = 1.0 / np.sqrt(q.shape[-1])
    d_p = do @ np.swapaxes(v, -1, -2)
    dz = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
    return [out, scale * dz @ k, scale * np.swapaxes(dz, -1, -2) @ q, np.swapaxes(p, -1, -2) @ do]


def ours(x: dict, impl: str) -> list[np.ndarray]:
    """Our float32 output and gradients with ``implementation=impl``."""
    args = (x["q"], x["k"], x["v"])
    out = sdpa_array.scaled_dot_product_attention(*args, implementation=impl, **x["opts"])
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        *args, x["do"], implementation=impl, **x["opts"]
    )
    return [out, *grads[:3]]


def torch_sdpa(x: dict, math: bool) -> list[np.ndarray]:
    """Torch's float32 output and autograd gradients, default backends or the math kernel."""
    q, k, v = (torch.from_numpy(x[n]).requires_grad_(True) for n in ("q", "k", "v"))
    opts = dict(x["opts"])
    if "mask" in opts:
        opts["attn_mask"] = torch.from_numpy(opts.pop("mask"))
    if "bias" in opts:
        opts["attn_mask"] = torch.from_numpy(opts.pop("bias"))
    if math:
        with sdpa_kernel([SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **opts)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **opts)
    out.backward(torch.from_numpy(x["do"]))
    return [t.detach().numpy() for t in (out, q.grad, k.grad, v.grad)]


class Pool:
    """Max abs and rel-RMS errors pooled over seeds, per quantity."""

    def __init__(self) -> None:
        self.max = dict.fromkeys(NAMES, 0.0)
        self.err2 = dict.fromkeys(NAMES, 0.0)
        self.ref2 = dict.fromkeys(NAMES, 0.0)

    def add(self, got: list[np.ndarray], want: list[np.ndarray]) -> None:
        for name, g, w in zip(NAMES, got, want, strict=True):
            d = g.astype(np.float64) - w
            self.max[name] = max(self.max[name], float(np.max(np.abs(d))))
            self.err2[name] += float(np.sum(d * d))
            self.ref2[name] += float(np.sum(w * w))

    def rms(self, name: str) -> float:
        return float(np.sqrt(self.err2[name] / self.ref2[name]))

    def metrics(self) -> dict[tuple[str, str], float]:
        return {
            **{(n, "max"): self.max[n] for n in NAMES},
            **{(n, "rms"): self.rms(n) for n in NAMES},
        }


def ratios(mine: dict, best: dict) -> dict[str, tuple[float, str]]:
    """Ours / best torch: forward and gradient (worst of dq, dk, dv), max abs and rel-RMS."""
    r = {}
    for metric in ("max", "rms"):
        r["fwd " + metric] = (mine["out", metric] / best["out", metric], "out")
        r["grad " + metric] = max(
            (mine[n, metric] / best[n, metric], n) for n in ("dq", "dk", "dv")
        )
    return r


def label(case: tuple) -> str:
    (b, h, n_q, n_k, e), variant, large = case
    return f"({b},{h},{n_q},{n_k},{e}) {variant} {'large' if large else 'unit'}"


def header() -> str:
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, NumPy "
        f"{np.__version__} ({blas['name']} {blas.get('version', '')}), torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads), sdpa_array "
        f"{getattr(sdpa_array, '__version__', '?')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds pooled per unit-logit case")
    ap.add_argument("--large-seeds", type=int, default=12, help="seeds pooled per large-logit case")
    ap.add_argument("--quick", action="store_true", help="L <= 256 and one seed")
    ap.add_argument("--jacobian-mb", type=float, default=128.0, help="oracle VJP memory cap")
    args = ap.parse_args()
    seeds = {False: 1, True: 1} if args.quick else {False: args.seeds, True: args.large_seeds}
    shapes = [s for s in SHAPES if not args.quick or s[2] <= 256]
    cases = [(s, v, lg) for s in shapes for v in VARIANTS for lg in (False, True)]
    print(header())
    print(
        f"float32, {seeds[False]} seed(s) per unit-logit case, {seeds[True]} per large-logit "
        "case; errors against the float64 oracle\n"
    )
    cols = [f"{n} {m}" for m in ("max", "rms") for n in NAMES]
    print("| case | path | " + " | ".join(cols) + " | fwd max; rms | grad max; rms |")
    print("|" + "---|" * (len(cols) + 4))
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    for case in cases:
        pools = {path: Pool() for path in PATHS}
        for seed in range(seeds[case[2]]):
            x = inputs(case, seed)
            want = oracle(x, args.jacobian_mb)
            for path in PATHS:
                if path.startswith("torch"):
                    got = torch_sdpa(x, math=path == "torch-math")
                else:
                    got = ours(x, path)
                pools[path].add(got, want)
        m = {path: pools[path].metrics() for path in PATHS}
        best = {key: min(m["torch-default"][key], m["torch-math"][key]) for key in m[PATHS[0]]}
        for path in PATHS:
            cells = [f"{m[path][n, met]:.3g}" for met in ("max", "rms") for n in NAMES]
            tail = ["", ""]
            if path == "torch-default":  # the same metric for torch's own kernel
                for key, (val, name) in ratios(m[path], best).items():
                    scope = "torch default itself"
                    if (scope, key) not in worst or val > worst[scope, key][0]:
                        worst[scope, key] = (val, f"{label(case)}, {path}, {name}")
            if not path.startswith("torch"):
                r = ratios(m[path], best)
                tail = [
                    f"{r['fwd max'][0]:.2f}; {r['fwd rms'][0]:.2f}",
                    f"{r['grad max'][0]:.2f} ({r['grad max'][1]}); "
                    f"{r['grad rms'][0]:.2f} ({r['grad rms'][1]})",
                ]
                for key, (val, name) in r.items():
                    for scope in ("all cases", "unit logits" if not case[2] else "large logits"):
                        if (scope, key) not in worst or val > worst[scope, key][0]:
                            worst[scope, key] = (val, f"{label(case)}, {path}, {name}")
            print(f"| {label(case)} | {path} | " + " | ".join(cells + tail) + " |", flush=True)
    for scope in ("all cases", "unit logits", "large logits", "torch default itself"):
        if (scope, "fwd max") not in worst:
            continue
        who = "torch default" if scope.startswith("torch") else "ours"
        print(f"\nworst ratios {who} / best torch, {scope}:")
        for key in ("fwd max", "fwd rms", "grad max", "grad rms"):
            val, where = worst[scope, key]
            print(f"  {key}: {val:.2f} at {where}")


if __name__ == "__main__":
    main()
