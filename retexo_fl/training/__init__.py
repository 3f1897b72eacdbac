"""The in-process engines: every party and the coordinator of a run in one process, without
Flower (lazy, eager / local, centralized); the two wings they host are :mod:`retexo_fl.party`
and :mod:`retexo_fl.coordinator`."""
