"""The error a benchmark stops with when it cannot run as asked; its message is for the user."""


class BenchError(RuntimeError):
    pass
