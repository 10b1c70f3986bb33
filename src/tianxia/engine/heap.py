"""The Python heap of a long-running process (an API server, an engine core).

A full (oldest-generation) garbage collection walks every object the process holds, and after
start-up that is millions of them: modules, the tokenizer, FastAPI's and torch's objects. Under
load such a collection runs every few seconds and stalls the event loop or the engine loop for
tens of milliseconds each time (80 ms in a served CPU run). None of those objects ever becomes
garbage, so after start-up they are moved out of the collector's view (``gc.freeze``), as vLLM
does in its API server and engine core; collections then walk only what serving allocated.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then keep everything alive now out of later collections."""
    gc.collect()
    gc.freeze()
