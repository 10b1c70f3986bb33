#!/usr/bin/env python
"""tianxia.lang programs end to end: prefix reuse vs no prefix cache vs naive completion calls.

Workloads (synthetic, generated from a fixed seed, so every configuration runs the same prompts):

- ``fewshot``: N programs (default 32), each a 24-shot reading-comprehension prompt (~2.2k
  tokens, the same for all) then its own passage and question; one gen (<= 16 tokens, stop "\\n").
- ``react``: N ReAct programs (default 32): a ~2.3k-token prompt of 8 ReAct trajectories, then
  3 steps of ``Thought`` (gen <= 48 tokens) / ``Action`` (gen <= 16) / ``Observation`` (a lookup
  tool in Python that reads the action). Always 3 steps, so every configuration does the same
  number of calls.
- ``react1``: one ReAct program alone (latency of a single agent).

Configurations (each in its own process, with a warm-up on different prompts first):

- ``lang``: the programs on ``tianxia.lang.Runtime`` (engine in-process, prefix cache on).
- ``lang-nocache``: the same with ``enable_prefix_caching=False``.
- ``lang-endpoint``: the programs on ``RuntimeEndpoint`` to ``tianxia serve`` (prefix cache on).
- ``naive``: the same logic written as separate ``/v1/completions`` calls with the whole text as
  the prompt, to ``tianxia serve --no-enable-prefix-caching``, programs run concurrently on threads.
- ``naive-cache``: the naive calls to a server with its prefix cache on.

    python benchmarks/lang_programs.py                       # all, -> benchmarks/results/lang-<date>/
    python benchmarks/lang_programs.py --configs lang,naive --programs 8 --reps 1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

CONFIGS = ("lang", "lang-nocache", "lang-endpoint", "naive", "naive-cache")
WORKLOADS = ("fewshot", "react", "react1")

# --- a small synthetic world of towns -----------------------------------------------------------

_HEADS = ["Ald", "Brook", "Cal", "Dun", "Elm", "Fair", "Glen", "Hart", "Ivy", "Kings", "Lark", "Mar",
          "North", "Oak", "Pen", "Quarry", "Red", "Stan", "Thorn", "Umber", "Vale", "West", "Yar", "Zell"]
_TAILS = ["by", "mere", "ford", "ton", "wick", "stead", "field", "worth", "haven", "bridge", "moor", "dale"]
_RIVERS = ["Avon", "Tamar", "Severn", "Wye", "Ouse", "Trent", "Derwent", "Exe", "Tees", "Eden"]
_CITIES = ["Carlisle", "Exeter", "Norwich", "York", "Durham", "Bath", "Lincoln", "Chester"]
_DIRS = ["north", "south", "east", "west"]
_FOUNDERS = ["Roger Hale", "Agnes Whitby", "Thomas Fenn", "Margaret Cole", "Edmund Price",
             "Isabel Marsh", "Walter Greave", "Alice Brandon", "Hugh Palmer", "Joan Fletcher"]
_INDUSTRIES = ["wool", "tin mining", "shipbuilding", "brewing", "pottery", "fishing", "printing",
               "glassmaking", "tanning", "clockmaking"]


def make_world(seed: int = 1234):
    rng = random.Random(seed)
    names = [h + t for h in _HEADS for t in _TAILS]
    rng.shuffle(names)
    towns = {}
    for name in names:
        ind = rng.sample(_INDUSTRIES, 2)
        towns[name] = {
            "name": name, "river": rng.choice(_RIVERS), "km": rng.randint(3, 60),
            "dir": rng.choice(_DIRS), "city": rng.choice(_CITIES), "year": rng.randint(1100, 1899),
            "founder": rng.choice(_FOUNDERS), "pop": rng.randint(8, 95) * 1000 + rng.randint(0, 999),
            "ind": ind,
        }
    return towns


def passage(t: dict) -> str:
    return (f"{t['name']} is a town on the {t['river']} river, {t['km']} kilometres {t['dir']} of "
            f"{t['city']}. It was founded in {t['year']} by {t['founder']}. About {t['pop']:,} people "
            f"live there today, and its main industries are {t['ind'][0]} and {t['ind'][1]}.")


def qa_item(t: dict, kind: int) -> tuple[str, str]:
    return [
        (f"When was {t['name']} founded?", str(t["year"])),
        (f"On which river does {t['name']} lie?", f"the {t['river']}"),
        (f"Who founded {t['name']}?", t["founder"]),
        (f"What are the main industries of {t['name']}?", f"{t['ind'][0]} and {t['ind'][1]}"),
        (f"How many people live in {t['name']}?", f"about {t['pop']:,}"),
    ][kind % 5]


WORLD = make_world()
_NAMES = list(WORLD)
# LANG_BENCH_SMALL=1: 2 shots and 1 trajectory (a smoke test of the script on a slow machine)
_SMALL = os.environ.get("LANG_BENCH_SMALL") == "1"

FEWSHOT = "Read each passage and answer the question in a few words.\n\n" + "".join(
    f"Passage: {passage(WORLD[n])}\nQuestion: {qa_item(WORLD[n], i)[0]}\nAnswer: {qa_item(WORLD[n], i)[1]}\n\n"
    for i, n in enumerate(_NAMES[: 2 if _SMALL else 24])
)


def fewshot_args(n: int, offset: int = 0) -> list[dict[str, str]]:
    out = []
    for i in range(n):
        t = WORLD[_NAMES[100 + (offset + i) % 150]]
        q, _ = qa_item(t, i)
        out.append({"passage": passage(t), "question": q})
    return out


def _trajectory(a: dict, b: dict) -> str:
    earlier = a if a["year"] < b["year"] else b
    return (
        f"Question: Which town was founded earlier, {a['name']} or {b['name']}?\n"
        f"Thought 1: I need to search {a['name']} and {b['name']}, and find which was founded earlier.\n"
        f"Action 1: Search[{a['name']}]\n"
        f"Observation 1: {passage(a)}\n"
        f"Thought 2: {a['name']} was founded in {a['year']}. I need to search {b['name']} next.\n"
        f"Action 2: Search[{b['name']}]\n"
        f"Observation 2: {passage(b)}\n"
        f"Thought 3: {b['name']} was founded in {b['year']}, so {earlier['name']} was founded earlier.\n"
        f"Action 3: Finish[{earlier['name']}]\n\n"
    )


REACT_PROMPT = (
    "Solve a question answering task with interleaving Thought, Action, Observation steps. Thought "
    "can reason about the current situation, and Action can be two types:\n"
    "(1) Search[town], which searches the town in the gazetteer and returns its entry.\n"
    "(2) Finish[answer], which returns the answer and finishes the task.\n"
    "Here are some examples.\n\n"
    + "".join(_trajectory(WORLD[_NAMES[30 + 2 * i]], WORLD[_NAMES[31 + 2 * i]]) for i in range(1 if _SMALL else 8))
)
REACT_STEPS = 3


def react_args(n: int, offset: int = 0) -> list[dict[str, str]]:
    out = []
    for i in range(n):
        a, b = _NAMES[200 + 2 * ((offset + i) % 40)], _NAMES[201 + 2 * ((offset + i) % 40)]
        out.append({"question": f"Which town was founded earlier, {a} or {b}?"})
    return out


def search_tool(action: str) -> str:
    m = re.search(r"(Search|Finish)\[([^\]]*)\]?", action)
    if m is None:
        return "Invalid action. Use Search[town] or Finish[answer]."
    if m.group(1) == "Finish":
        return "Episode finished."
    name = m.group(2).strip()
    if name in WORLD:
        return passage(WORLD[name])
    similar = [n for n in _NAMES if n[:3] == name[:3]][:3]
    return f"Could not find [{name}]. Similar: {similar}."


# --- the programs -------------------------------------------------------------------------------


def lang_programs():
    import tianxia.lang as sgl

    @sgl.function
    def fewshot_qa(s, header, passage, question):
        s += header + FEWSHOT
        s += "Passage: " + passage + "\nQuestion: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=16, stop="\n")

    @sgl.function
    def react(s, header, question):
        s += header + REACT_PROMPT + "Question: " + question + "\n"
        for i in range(1, REACT_STEPS + 1):
            s += f"Thought {i}:" + sgl.gen(f"thought{i}", max_tokens=48, stop="\n")
            s += f"\nAction {i}:" + sgl.gen(f"action{i}", max_tokens=16, stop="\n")
            s += f"\nObservation {i}: " + search_tool(s[f"action{i}"]) + "\n"

    return {"fewshot": fewshot_qa, "react": react, "react1": react}


class NaiveClient:
    """The same logic as plain HTTP completion calls: every call sends the whole text."""

    def __init__(self, url: str) -> None:
        import httpx

        self.http = httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256))

    def complete(self, prompt: str, max_tokens: int, stop: str) -> str:
        res = self.http.post("/v1/completions", json={
            "model": "m", "prompt": prompt, "max_tokens": max_tokens, "stop": [stop], "temperature": 0})
        res.raise_for_status()
        return res.json()["choices"][0]["text"]

    def fewshot(self, header: str, passage: str, question: str) -> str:
        text = header + FEWSHOT + "Passage: " + passage + "\nQuestion: " + question + "\nAnswer:"
        return text + self.complete(text, 16, "\n")

    def react(self, header: str, question: str) -> str:
        text = header + REACT_PROMPT + "Question: " + question + "\n"
        for i in range(1, REACT_STEPS + 1):
            text += f"Thought {i}:"
            text += self.complete(text, 48, "\n")
            text += f"\nAction {i}:"
            action = self.complete(text, 16, "\n")
            text += action + f"\nObservation {i}: " + search_tool(action) + "\n"
        return text


# --- one configuration --------------------------------------------------------------------------


def server_counters(url: str) -> dict[str, float]:
    import httpx

    from tianxia.server.testing import metric

    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for key, name in (("prompt_tokens", "vllm:prompt_tokens"), ("generation_tokens", "vllm:generation_tokens"),
                      ("prefix_cache_hits", "vllm:prefix_cache_hits")):
        value = metric(text, name + "_total")
        out[key] = value if value is not None else (metric(text, name) or 0.0)
    return out


def run_config(config: str, args) -> dict:
    import tianxia.lang as sgl

    progs = lang_programs()
    sizes = {"fewshot": args.programs, "react": args.programs, "react1": 1}
    make = {"fewshot": fewshot_args, "react": react_args, "react1": react_args}
    engine_args = {"kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len,
                       "max_num_seqs": args.max_num_seqs, "device": args.device}
    server = backend = naive = None
    counters = None
    if config in ("lang", "lang-nocache"):
        backend = sgl.Runtime(args.model, enable_prefix_caching=config == "lang", **engine_args)
        counters = backend.stats
    else:
        from tianxia.server.testing import ServerProcess

        cmd = [args.model, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
               str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs), "--device",
               args.device, "--served-model-name", "m"]
        if config == "naive":
            cmd.append("--no-enable-prefix-caching")
        server = ServerProcess(cmd, startup_timeout=600).start()
        counters = lambda: server_counters(server.url)
        if config == "lang-endpoint":
            backend = sgl.RuntimeEndpoint(server.url)
        else:
            naive = NaiveClient(server.url)

    def run(workload: str, header: str, n: int, offset: int) -> tuple[float, list[str]]:
        batch = [{"header": header, **a} for a in make[workload](n, offset)]
        t0 = time.perf_counter()
        if naive is not None:
            fn = naive.fewshot if workload == "fewshot" else naive.react
            with ThreadPoolExecutor(max(1, len(batch))) as pool:
                texts = list(pool.map(lambda a: fn(**a), batch))
        else:
            states = progs[workload].run_batch(batch, backend=backend, num_threads=len(batch), temperature=0)
            texts = [s.text() for s in states]
            errors = [s.error() for s in states if s.error() is not None]
            if errors:
                raise errors[0]
        return time.perf_counter() - t0, texts

    result = {"config": config, "workloads": {}}
    if config in ("lang", "lang-nocache"):
        tok = backend.get_tokenizer()
        result["prompt_lengths"] = {"fewshot": len(tok.encode(FEWSHOT)), "react": len(tok.encode(REACT_PROMPT))}
    try:
        # warm-up on other prompts (its own header, so it shares no cache block with the runs)
        run("fewshot", "[warm-up]\n", min(8, args.programs), 7)
        run("react", "[warm-up]\n", min(4, args.programs), 7)
        for workload in args.workloads:
            runs = []
            for rep in range(args.reps):
                before = counters()
                seconds, texts = run(workload, f"[run {rep}]\n", sizes[workload], 0)
                after = counters()
                runs.append({
                    "seconds": seconds,
                    "prefill_tokens": after["prompt_tokens"] - before["prompt_tokens"],
                    "cache_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
                    "generated_tokens": after["generation_tokens"] - before["generation_tokens"],
                    "sample": texts[0][-300:],
                })
                print(f"{config:14s} {workload:8s} rep {rep}: {seconds:7.2f} s  "
                      f"prefill {runs[-1]['prefill_tokens']:.0f}  hits {runs[-1]['cache_hit_tokens']:.0f}  "
                      f"gen {runs[-1]['generated_tokens']:.0f}", flush=True)
            result["workloads"][workload] = runs
    finally:
        if backend is not None:
            backend.shutdown()
        if server is not None:
            server.stop()
    return result


# --- the report ---------------------------------------------------------------------------------


def table(results: list[dict], args) -> str:
    by = {r["config"]: r for r in results}
    lines = []
    titles = {"fewshot": f"few-shot QA, batch of {args.programs}", "react": f"ReAct, batch of {args.programs}",
              "react1": "ReAct, one program"}
    for workload in args.workloads:
        lines.append(f"\n**{titles[workload]}** (mean of {args.reps} runs)\n")
        lines.append("| configuration | latency (s) | prefilled tokens | cache-hit tokens | generated tokens | speedup vs naive |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        base = None
        if "naive" in by and workload in by["naive"]["workloads"]:
            runs = by["naive"]["workloads"][workload]
            base = sum(r["seconds"] for r in runs) / len(runs)
        for config in CONFIGS:
            if config not in by or workload not in by[config]["workloads"]:
                continue
            runs = by[config]["workloads"][workload]
            def mean(key: str, runs: list = runs) -> float:
                return sum(r[key] for r in runs) / len(runs)

            sec = mean("seconds")
            speed = f"{base / sec:.2f}x" if base else "-"
            lines.append(f"| {config} | {sec:.2f} | {mean('prefill_tokens'):.0f} | "
                         f"{mean('cache_hit_tokens'):.0f} | {mean('generated_tokens'):.0f} | {speed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--programs", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv-cache-memory", default="8GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--out", default=None, help="output folder")
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one config, in this process
    args = ap.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    if args.only:
        result = run_config(args.only, args)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    out = Path(args.out or REPO / "benchmarks" / "results" / f"lang-{dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for config in [c for c in args.configs.split(",") if c]:
        path = out / f"{config}.json"
        cmd = [sys.executable, __file__, "--only", config, "--out", str(path), "--model", args.model,
               "--workloads", ",".join(args.workloads), "--programs", str(args.programs),
               "--reps", str(args.reps), "--device", args.device, "--kv-cache-memory",
               args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.max_num_seqs)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        results.append(json.loads(path.read_text()))
    report = table(results, args)
    for r in results:
        if "prompt_lengths" in r:
            report += (f"\nshared prompts: few-shot {r['prompt_lengths']['fewshot']} tokens, "
                       f"ReAct {r['prompt_lengths']['react']} tokens\n")
            break
    (out / "lang_programs.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
