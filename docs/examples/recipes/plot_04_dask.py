r"""
Attention on a Dask cluster
===========================

With Dask arrays as ``query``, ``key`` and ``value``,
:func:`sdpa_array.scaled_dot_product_attention` builds a task graph that follows their
chunks and returns a lazy Dask array: one task per (query chunk, key chunk) pair computes
that pair's partial output and log-sum-exp, and a tree of
:func:`sdpa_array.merge_attention_states` tasks combines the partials of each query chunk.
For two key chunks with partial outputs :math:`o^{(1)}, o^{(2)}` and log-sum-exps
:math:`\ell^{(1)}, \ell^{(2)}` the merge is exact:

.. math::

   \ell = \log\bigl(e^{\ell^{(1)}} + e^{\ell^{(2)}}\bigr), \qquad
   o = e^{\ell^{(1)} - \ell}\, o^{(1)} + e^{\ell^{(2)} - \ell}\, o^{(2)} .

Pairs that ``is_causal`` excludes entirely get no task. Any Dask scheduler runs the graph;
here a :class:`dask.distributed.LocalCluster` in this process (threads, no network), the
same code that runs on a real cluster with another ``Client`` (see :doc:`/distributed`).
"""

# %%
import dask
import dask.array as da
import matplotlib.pyplot as plt
import numpy as np
from dask.distributed import Client, LocalCluster

from sdpa_array import scaled_dot_product_attention

rng = np.random.default_rng(0)
B, H, N, E, CHUNK = 1, 2, 1024, 32, 128
q_np, k_np, v_np = (rng.standard_normal((B, H, N, E), dtype=np.float32) for _ in range(3))

# (batch, heads, length, width), chunked one head at a time and 256 tokens along the length
chunks = (1, 1, CHUNK, E)
q, k, v = (da.from_array(x, chunks=chunks) for x in (q_np, k_np, v_np))

out = scaled_dot_product_attention(q, k, v, is_causal=True)  # builds the graph only
print(type(out).__name__, out.shape, "chunks along L:", out.chunks[2])
full = scaled_dot_product_attention(q, k, v)
n_causal, n_full = len(out.__dask_graph__()), len(full.__dask_graph__())
print(f"tasks: {n_causal} causal, {n_full} without a mask")

# %%
# Running it on a cluster
# -----------------------
#
# ``processes=False`` keeps the workers in this process, and no dashboard is started; on a
# real cluster ``Client("scheduler-address:8786")`` is the only change.

with (
    LocalCluster(
        n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
    ) as cluster,
    Client(cluster) as client,
):
    result = out.compute()

expected = scaled_dot_product_attention(q_np, k_np, v_np, is_causal=True)
print(f"cluster vs NumPy in one call: max |diff| = {np.abs(result - expected).max():.1e}")

# %%
# The threaded scheduler runs the same graph without a cluster:

with dask.config.set(scheduler="threads"):
    print(f"threaded scheduler: max |diff| = {np.abs(out.compute() - expected).max():.1e}")

# %%
# Which pairs get a task
# ----------------------
#
# With ``is_causal``, the query chunk :math:`a` attends key chunk :math:`b` only for
# :math:`b \le a`: the pairs above the diagonal make no task, and the graph has
# :math:`n (n + 1) / 2` pair tasks per head instead of :math:`n^2`.

n = N // CHUNK
pairs = np.tril(np.ones((n, n)))
fig, ax = plt.subplots(figsize=(3.6, 3.2), layout="constrained")
ax.imshow(pairs, cmap="Blues", vmin=0, vmax=1.4)
ax.set(
    xlabel="key chunk",
    ylabel="query chunk",
    title=f"causal: {int(pairs.sum())} of {n * n} pairs",
)
plt.show()
