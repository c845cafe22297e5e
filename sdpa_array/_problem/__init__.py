"""The problem layer: a call validated into a :class:`~.problem.Problem` (:mod:`.problem`)
from its options record (:mod:`.options`), the band (:mod:`.band`), lengths and segments
(:mod:`.sequences`), and mask and bias functions (:mod:`.mod_args`, :mod:`.mod_calls`,
:mod:`.mods_data`, :mod:`.block_mask`). It imports no kernel."""
