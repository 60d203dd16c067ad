"""Tables of experiments: a table file (:mod:`~mmlight.experiments.table`), ``mmlight sweep``
(:mod:`~mmlight.experiments.sweep`) runs it, ``mmlight collect`` (:mod:`~mmlight.experiments.collect`)
writes the result."""
