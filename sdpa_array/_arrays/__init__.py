"""Array helpers below the kernels: slicing tiles and batch slices (:mod:`.slicing`),
in-place updates where a library allows them (:mod:`.inplace`) and the NumPy thread pool
(:mod:`.parallel`). They know arrays and namespaces, nothing of attention's problem."""
