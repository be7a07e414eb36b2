"""A serving process freezes its start-up heap (so full collections during traffic skip it) and an
engine's release thaws it (so what the engine held can be collected)."""

from __future__ import annotations

import gc

from ferrum.engine.heap import freeze_startup_heap, thaw_heap


def test_freeze_moves_the_live_heap_out_of_the_collector_and_thaw_brings_it_back() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    try:
        kept = Node()
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        before = len(gc.get_objects())
        assert all(obj is not kept for obj in gc.get_objects())  # frozen: no generation lists it
        thaw_heap()
        assert gc.get_freeze_count() == 0 and len(gc.get_objects()) > before
        assert any(obj is kept for obj in gc.get_objects())
    finally:
        thaw_heap()
