"""Time every garbage collection a process runs after ``gc.freeze`` (after start-up), and write
the totals at exit: put this directory first on ``PYTHONPATH`` and set ``GC_TIMER_DIR``.

    GC_TIMER_DIR=/tmp/gc PYTHONPATH=benchmarks/gc_timer:src \\
        python benchmarks/server_overhead.py --device cpu --requests 256

Each process started with that environment writes ``GC_TIMER_DIR/gc_<pid>.json`` when it exits
normally (the API process does; an engine core ended by its parent does not).
"""

import atexit
import gc
import json
import os
import sys
import time

_dir = os.environ.get("GC_TIMER_DIR")
if _dir:
    _frozen = False
    _start = 0.0
    _stats = {"argv": " ".join(sys.argv)[:120], "collections": [0, 0, 0], "ms": [0.0, 0.0, 0.0],
              "max_pause_ms": 0.0}
    _freeze = gc.freeze

    def _freeze_and_count() -> None:
        global _frozen
        _freeze()
        _frozen = True

    def _timer(phase: str, info: dict) -> None:
        global _start
        if not _frozen:
            return
        if phase == "start":
            _start = time.perf_counter()
            return
        ms = (time.perf_counter() - _start) * 1e3
        g = info["generation"]
        _stats["collections"][g] += 1
        _stats["ms"][g] += ms
        _stats["max_pause_ms"] = max(_stats["max_pause_ms"], ms)

    def _write() -> None:
        _stats["ms"] = [round(x, 1) for x in _stats["ms"]]
        _stats["max_pause_ms"] = round(_stats["max_pause_ms"], 1)
        _stats["cpu_s"] = round(time.process_time(), 2)
        with open(os.path.join(_dir, f"gc_{os.getpid()}.json"), "w") as f:
            json.dump(_stats, f)

    gc.freeze = _freeze_and_count
    gc.callbacks.append(_timer)
    atexit.register(_write)
