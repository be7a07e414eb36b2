"""Tensor parallelism: one model split across N ranks, rank 0 the engine and ranks 1..N-1 worker
processes, every rank built by the same set-up path (rank.py) and kept in step by rank 0's runner."""
