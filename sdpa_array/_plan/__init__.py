"""One plan per call: the plan itself (:mod:`.plan`), the table of implementations and
the one ``choose`` (:mod:`.dispatch`), and the autograd wrappers around our backward kernels
(:mod:`.autograd`)."""
