"""The maths of attention, written once against the Array API (private).

The forward and backward kernels share one pipeline, one module a step:

* :mod:`.layout`, :mod:`.slicing`: the kernel layout (batch axes, GQA groups, tiles);
* :mod:`.restrictions`: every restriction behind one interface that classifies a tile as
  empty, full or partial and builds the boolean mask of partial tiles only;
* :mod:`.score_terms`: every term that changes a score's value (scale, soft-cap, bias,
  sinks);
* :mod:`.sequences`, :mod:`.mod_terms`: the restrictions of lengths and segment ids, and
  the mask and bias functions (``mask_mod``/``bias_mod``) as a restriction and a term;
* :mod:`.operands`: the caller's arrays prepared once, and :func:`~.operands.tile_scores`;
* :mod:`.softmax`: the NaN-free softmax pieces;
* :mod:`.tiling`: block sizes, tile plans and batch splits of the blocked kernels;
* :mod:`.materialized`, :mod:`.blocked`: forward kernels;
* :mod:`.gradients`, :mod:`.vjp_materialized`, :mod:`.vjp_blocked`: backward kernels;
* :mod:`.native`: delegation to torch's and JAX's fused kernels (the one table of them);
* :mod:`.parallel`, :mod:`.inplace`: the NumPy thread pool and in-place updates, the only
  library-specific choices of the generic kernels.

:mod:`sdpa_array._plan.dispatch` lists the kernels and chooses one per call.
"""
