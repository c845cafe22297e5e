"""A transformers model's forward pass through the adapter against transformers' ``sdpa``.

The target: a Llama-style model (2 layers, hidden 256, 8 heads, 1024 tokens, batch
4, left-padded, float32, CPU) within 1.1x of transformers' own ``sdpa`` attention. The same
model (same weights) is switched between ``array_attention`` (this library, through
``sdpa_array.integrations.transformers``) and ``sdpa`` every round; each round times one
forward of each, in alternating order; the table gives the median over rounds, the
min-max, and the ratio of the medians, plus each forward's peak traced memory growth::

    python asv_benchmarks/studies/transformers_bench.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()

    import torch
    import transformers

    from sdpa_array.integrations.transformers import register

    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=args.length,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    B, L = args.batch, args.length
    ids = torch.randint(1, 1000, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    for b in range(B):  # left padding: row b misses b * L / 8 tokens
        mask[b, : b * L // 8] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    names = {"ours": register(), "sdpa": "sdpa"}
    times: dict[str, list[float]] = {k: [] for k in names}

    def forward(impl: str) -> float:
        model.set_attn_implementation(impl)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=positions)
        return time.perf_counter() - t0

    for impl in names.values():  # warm-up
        forward(impl)
    for r in range(args.rounds):
        order = list(names.items())[:: 1 if r % 2 == 0 else -1]
        for key, impl in order:
            times[key].append(forward(impl))
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} cores; B={B}, L={L}, float32"
    )
    for key, ts in times.items():
        print(
            f"{key:5s} {statistics.median(ts) * 1e3:8.1f} ms "
            f"({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"
        )
    ratios = [a / b for a, b in zip(times["ours"], times["sdpa"], strict=True)]
    print(
        f"ours / sdpa: {statistics.median(times['ours']) / statistics.median(times['sdpa']):.3f}"
        f" (per round {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
