"""The coordinator wing: what runs on the server.

The stage machine (:mod:`~retexo_fl.coordinator.stages`), the round loop and its aggregation
hooks (:mod:`~retexo_fl.coordinator.round_loop`, :mod:`~retexo_fl.coordinator.round_aggregation`),
the eager / local baselines' run (:mod:`~retexo_fl.coordinator.baseline_run`), the view of the
clients it reaches through a :class:`~retexo_fl.coordinator.transport.Transport`
(:mod:`~retexo_fl.coordinator.federation`), aggregation, model selection, checkpoints, privacy
accounting and its half of secure aggregation. Nothing here imports :mod:`retexo_fl.party`.
"""
