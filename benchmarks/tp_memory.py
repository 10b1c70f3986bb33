"""Peak resident memory of each tensor-parallel rank (VmHWM: the high-water mark of its resident
set, file-backed pages of the mapped model file included), after loading and a short greedy run.

    PYTHONPATH=src python benchmarks/tp_memory.py 2 qwen2.5-coder-0.5b
"""

from __future__ import annotations

import sys


def hwm(pid: int | str) -> float:
    """Peak resident memory (VmHWM) of a process, MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    from tianxia import LLM, SamplingParams

    tp, model = int(sys.argv[1]), sys.argv[2]
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory="64MiB", max_model_len=512)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    workers = getattr(llm.engine.runner.model, "workers", None)
    peaks = [hwm("self")] + [hwm(p.pid) for p in (workers.procs if workers else [])]
    print(f"tp={tp} {model}: peak RSS per rank (MiB) {[round(p) for p in peaks]}; "
          f"text {out[0].outputs[0].text!r}", flush=True)


if __name__ == "__main__":
    main()
