"""`ferrum bench`: a seeded random workload run through the engine in-process (`offline`) or
against a running server at several concurrency levels (`serve`)."""
