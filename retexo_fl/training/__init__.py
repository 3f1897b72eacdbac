"""Training engines: the lazy client, aggregation, in-process lazy and centralized runs."""
