"""The Python heap of a long-running process (an API server, an engine core).

A full (oldest-generation) garbage collection walks every object the process holds, and after
start-up that is millions of them: modules, the tokenizer, FastAPI's and torch's objects. Under
load such a collection runs every few seconds and stalls the event loop or the engine loop for
tens of milliseconds each time (80 ms in a served CPU run). None of those objects ever becomes
garbage, so after start-up they are moved out of the collector's view (``gc.freeze``), as vLLM
does in its API server and engine core; collections then walk only what serving allocated.

What serving allocates is mostly freed by reference counting within a step (outputs, deltas,
chunks), but the collector still runs every :data:`YOUNG_THRESHOLD` allocations of containers.
At CPython's default of 700, an API process streaming 256 requests ran a young collection every
few steps and a full one every few seconds, walking every in-flight request's objects: a sixth
of its CPU went to the collector, in pauses of up to 98 ms. At 50,000 the same load ran 4 young
collections, none longer than 32 ms, and no full one (BENCHMARKS.md, runs 40-43).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def freeze_startup_heap() -> None:
    """Collect once, keep everything alive now out of later collections, and collect the young
    generation every :data:`YOUNG_THRESHOLD` allocations (the older ones as by default, every 10
    younger collections)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 10, 10)
