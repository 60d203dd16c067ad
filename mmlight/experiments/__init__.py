"""Tables of experiments: a table file (:mod:`~mmlight.experiments.table`), its runs and their recorded
statuses and metrics. ``mmlight sweep`` (:mod:`mmlight.commands.sweep`) runs a table, ``mmlight collect``
(:mod:`mmlight.commands.collect`) writes its results."""
