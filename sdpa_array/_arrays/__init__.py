"""Array helpers below the kernels: slicing tiles and batch slices (:mod:`.slicing`),
in-place updates where a library allows them (:mod:`.inplace`), the NumPy thread pool
(:mod:`.parallel`) and the merge of partial attention results (:mod:`.merge`); below them,
the array-library compatibility layer (:mod:`.compat`) and the type names (:mod:`.typing`).
They know arrays and namespaces, nothing of attention's problem."""
