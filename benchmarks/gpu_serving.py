"""``tianxia serve`` on one GPU under ``tianxia bench sweep``: the 128-in / 64-out workload at
rising request rates, for random-weight models of real shapes.

For each shape: save a random-weight model with Qwen2.5's tokenizer (``--tokenizer-dir``; the
workload's prompts are random whole words, re-tokenized to exactly 128 tokens), start ``tianxia serve`` on it (CUDA graphs, KV cache
from ``--gpu-memory-utilization``), run the sweep (Poisson arrivals, ``ignore_eos``, every request
exactly 64 output tokens), stop the server. Writes ``serve_<shape>.json`` / ``.png`` per shape and
``gpu_serving.md`` (requests/s, output tokens/s, TTFT / TPOT percentiles per rate, the share of
a core each of the server's processes and the load generator used at each rate, and the engine
steps each rate took, from ``/metrics``, against those of the same workload offline).

The offline side runs after the server stops (``--repeats`` runs each side N times), or, with
``--interleave``, in a process of its own beside the server, one offline run after each served
point at rate ``inf``: a lent host's speed drifts by tens of percent over minutes, and pairs a
few seconds apart compare like with like (``median_pair_ratio``).

    PYTHONPATH=src python benchmarks/gpu_serving.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def triton_cache_entries() -> set[str]:
    """``entry/kernel`` for each compiled kernel in the Triton cache (an entry holds one kernel's
    ``<name>.json`` beside its binaries)."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if not cache.is_dir():
        return set()
    return {f"{d.name}/{f.stem}" for d in cache.iterdir() if d.is_dir()
            for f in d.glob("*.json") if not f.name.startswith("__grp__")}


def process_cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of each process started from this one (the server, its engine
    cores, the load generator), keyed ``pid command``."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            procs[int(d.name)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / tick, cmd[:70].strip())
    ours, grew = {os.getpid()}, True
    while grew:
        new = {pid for pid, (ppid, _, _) in procs.items() if ppid in ours} - ours
        ours |= new
        grew = bool(new)
    return {f"{pid} {procs[pid][2]}": procs[pid][1] for pid in ours if pid != os.getpid()}


class StackSampler:
    """``py-spy record`` on each of the server's processes while a load point runs (``--py-spy``):
    collapsed stacks, one file per process, to see where a process that limits serving spends
    its time. Does nothing where py-spy is not installed."""

    def __init__(self, out: Path | None, tag: str) -> None:
        self.out, self.tag, self.procs = out, tag, []

    def __enter__(self) -> StackSampler:
        exe = shutil.which("py-spy")
        if self.out is None or exe is None:
            return self
        self.out.mkdir(parents=True, exist_ok=True)
        for key in process_cpu_seconds():
            pid, cmd = key.split(" ", 1)
            if "tianxia.cli serve" in cmd or "multiprocessing.spawn" in cmd:
                self.procs.append(subprocess.Popen(
                    [exe, "record", "--pid", pid, "--rate", "200", "--format", "raw", "--nonblocking",
                     "--output", str(self.out / f"{self.tag}_{pid}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


class Poller(threading.Thread):
    """A thread that appends ``(time.monotonic(), self.sample())`` to :attr:`samples` every
    ``interval`` seconds while its ``with`` block runs; a sample that raises :class:`OSError`
    (a server that did not answer) is skipped."""

    interval = 0.2

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple] = []
        self._done = threading.Event()

    def sample(self):
        raise NotImplementedError

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self.samples.append((time.monotonic(), self.sample()))
            except OSError:
                pass
            self._done.wait(self.interval)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self.join()


class CpuSampler(Poller):
    """Samples :func:`process_cpu_seconds` every 0.2 s while a load point runs; :meth:`busiest`
    gives each process's share of a core over the window of the point's duration where the
    processes together were busiest (the load itself, not the load generator's start-up)."""

    def sample(self) -> dict[str, float]:
        return process_cpu_seconds()

    def busiest(self, duration: float) -> dict[str, float]:
        best, share = -1.0, {}
        for i, (t0, c0) in enumerate(self.samples):
            j = next((j for j in range(i + 1, len(self.samples)) if self.samples[j][0] - t0 >= duration), None)
            if j is None:
                break
            t1, c1 = self.samples[j]
            use = {k: (c1[k] - c0[k]) / (t1 - t0) for k in c1 if k in c0}
            if sum(use.values()) > best:
                best, share = sum(use.values()), {k: round(v, 2) for k, v in use.items()}
        return share


class QueueSampler(Poller):
    """Polls the server's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` every
    0.1 s while a load point runs, to tell where a short batch comes from: a batch below
    ``--max-num-seqs`` while requests wait in the core is the scheduler's doing; one while none
    wait, before the point's last waiting request was admitted, means requests were not reaching
    the core fast enough (the load generator or the API processes); the rest is the final drain."""

    interval = 0.1

    def __init__(self, base: str, max_num_seqs: int) -> None:
        import httpx

        super().__init__()
        self.base, self.max_num_seqs = base, max_num_seqs
        self._client = httpx.Client(timeout=5)

    def sample(self) -> tuple[float, float]:
        """(running, waiting); an unanswered poll is an OSError (httpx's transport errors are
        not), so it is skipped."""
        import httpx

        from tianxia.server.testing import parse_metrics

        try:
            rows = parse_metrics(self._client.get(self.base + "/metrics").text)
        except httpx.HTTPError as e:
            raise OSError(str(e)) from e
        got = {n: v for n, _, v in rows if n in ("vllm:num_requests_running", "vllm:num_requests_waiting")}
        return got.get("vllm:num_requests_running", 0.0), got.get("vllm:num_requests_waiting", 0.0)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._client.close()

    def summary(self) -> dict[str, float]:
        busy = [(t, r, w) for t, (r, w) in self.samples if r or w]
        if not busy:
            return {}
        last_waiting = max((t for t, _, w in busy if w), default=busy[0][0])
        before = [(r, w) for t, r, w in busy if t <= last_waiting]
        full = self.max_num_seqs
        return {
            "samples": len(busy),
            "running_mean_while_waiting": round(statistics.fmean(
                [r for r, w in before if w] or [0.0]), 1),
            "short_while_waiting": sum(1 for r, w in before if w and r < full),
            "starved": sum(1 for r, w in before if not w and r < full),
            "drain_s": round(busy[-1][0] - last_waiting, 2),
            "running_mean_drain": round(statistics.fmean(
                [r for t, r, w in busy if t > last_waiting] or [0.0]), 1),
        }


def queue_line(q: dict[str, float]) -> str:
    if not q:
        return "no queue samples"
    return (f"{q['samples']:.0f} queue samples: while requests waited in the core {q['running_mean_while_waiting']} "
            f"ran on average, {q['short_while_waiting']:.0f} samples short of the full batch; "
            f"{q['starved']:.0f} samples short with none waiting before the last admission; "
            f"then {q['drain_s']} s of drain at {q['running_mean_drain']} running")


_STEP_LINE = re.compile(r"step \d+ at ([\d.]+): (\d+) seqs \((\d+) decodes\), (\d+) tokens, ([\d.]+) ms")


def log_since(log_path: Path, offset: int) -> str:
    """The server's log after byte ``offset``."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def logged_steps(log: str) -> list[tuple[float, float, int, int, int]]:
    """The engine steps the server logged (``--log-level debug``) in ``log``: (start s from the
    first, took ms, sequences, decodes, tokens) each."""
    rows = [(float(t), float(ms), int(n), int(d), int(k)) for t, n, d, k, ms in _STEP_LINE.findall(log)]
    t0 = rows[0][0] if rows else 0.0
    return [(round(t - t0, 4), ms, n, d, k) for t, ms, n, d, k in rows]


def steps_after(log: str, start: float) -> dict:
    """When the engine ran its first logged step at or after ``start`` (a load generator's start on
    the host's monotonic clock, which the server logs on), and its first step of as many sequences
    as any of those steps carried; seconds after ``start``. Empty when no step came after it."""
    rows = [(float(t) - start, int(n)) for t, n, *_ in _STEP_LINE.findall(log) if float(t) >= start]
    if not rows:
        return {}
    most = max(n for _, n in rows)
    full = next(t for t, n in rows if n == most)
    return {"first_step_s": round(rows[0][0], 3), "largest_step_seqs": most,
            "largest_step_s": round(full, 3), "steps": len(rows)}


def small_steps_line(steps: list[tuple[float, float, int, int, int]], half: int = 128) -> str:
    """Where a run's steps of ``half`` sequences or fewer are: how many carry no decode (prompts
    only), and how they fall over the run's tenths."""
    small = [s for s in steps if s[2] <= half]
    if not steps:
        return "no steps logged"
    end = steps[-1][0] or 1.0
    tenths = [0] * 10
    for t, *_ in small:
        tenths[min(int(10 * t / end), 9)] += 1
    return (f"{len(steps)} steps logged, {len(small)} of {half} sequences or fewer "
            f"({sum(1 for s in small if s[3] == 0)} with no decode); by tenth of the run {tenths}")


def served_steps(base: str) -> dict[str, float]:
    """The server's engine steps so far (every core): how many, the seconds they took
    (``tianxia:step_duration_seconds``), the sequences and tokens they carried
    (``tianxia:step_num_seqs``, ``vllm:iteration_tokens_total``) and how many carried at most half
    of ``--max-num-seqs`` (the histogram's bucket at 128)."""
    import httpx

    from tianxia.server.testing import parse_metrics

    text = httpx.get(base + "/metrics", timeout=10).text
    rows = parse_metrics(text)

    def total(name: str, **labels: str) -> float:
        return sum(value for n, lab, value in rows
                   if n == name and all(lab.get(k) == v for k, v in labels.items()))

    return {"steps": total("tianxia:step_duration_seconds_count"),
            "busy_s": total("tianxia:step_duration_seconds_sum"),
            "seqs": total("tianxia:step_num_seqs_sum"),
            "tokens": total("vllm:iteration_tokens_total_sum"),
            "half_full": total("tianxia:step_num_seqs_bucket", le="128.0")}


def step_sizes(steps: float, seqs: float, tokens: float, half_full: float) -> str:
    """One line: the mean batch of a run's steps, served or offline, to tell a run that kept its
    batch full from one that ran more, smaller steps."""
    n = max(steps, 1)
    return (f"{seqs / n:.1f} sequences and {tokens / n:.0f} tokens a step; {half_full:.0f} steps "
            f"of 128 sequences or fewer")


class OfflineRunner:
    """``args.prompts_per_point`` requests of 128 random prompt tokens and 64 output tokens
    (``ignore_eos``) through ``LLM.generate`` with the server's engine settings, all submitted at
    once: the ceiling the served figure at rate ``inf`` is compared with. Each run has prompts of
    its own (none hits the prefix cache an earlier run filled)."""

    def __init__(self, model_dir: Path, args) -> None:
        import random

        from tianxia import LLM, SamplingParams

        self.llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs, max_model_len=2048,
                       gpu_memory_utilization=0.85)
        self.vocab = self.llm.get_tokenizer().vocab_size
        self.n = args.prompts_per_point
        self.params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=args.temperature,
                                     top_p=args.top_p)
        warm = random.Random(-1)
        self.llm.generate([{"prompt_token_ids": [warm.randrange(1000, self.vocab - 1000) for _ in range(128)]}
                           for _ in range(16)], self.params, use_tqdm=False)
        engine = self.llm.engine
        step = engine.step
        self.steps, self.timeline = 0, []  # (start s, took ms, seqs, tokens) per step

        def counted_step(eng=engine):
            self.steps += 1
            t = time.monotonic()
            out = step()
            sched = eng.last_applied
            if sched is not None:
                self.timeline.append((round(t, 4), round(1000 * (time.monotonic() - t), 2),
                                      len(sched.scheduled), sum(n for _, n in sched.scheduled)))
            return out

        engine.step = counted_step

    def run(self, rep: int) -> tuple[float, int, list]:
        """Output tokens/s, engine steps and the step timeline of run ``rep``."""
        import random

        rng = random.Random(rep)
        prompts = [{"prompt_token_ids": [rng.randrange(1000, self.vocab - 1000) for _ in range(128)]}
                   for _ in range(self.n)]
        self.steps, self.timeline = 0, []
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        busy = sum(took for _, took, _, _ in self.timeline) / 1000
        print(f"  offline run {rep}: {n / dt:.1f} output tok/s, {self.steps} engine steps, "
              f"{1000 * busy / max(self.steps, 1):.2f} ms a step; in steps {busy:.2f} s of {dt:.2f} s", flush=True)
        print("  offline run {}: {}".format(rep, step_sizes(
            len(self.timeline), sum(s for _, _, s, _ in self.timeline), sum(t for _, _, _, t in self.timeline),
            sum(1 for _, _, s, _ in self.timeline if s <= 128))), flush=True)
        return n / dt, self.steps, self.timeline


def offline_throughput(model_dir: Path, args) -> list[tuple[float, int]]:
    """``args.repeats`` offline runs in one engine, after the server stopped; output tokens/s and
    engine steps of each."""
    import torch

    runner = OfflineRunner(model_dir, args)
    runs, timelines = [], []
    for rep in range(args.repeats):
        tok_s, steps, timeline = runner.run(rep)
        runs.append((tok_s, steps))
        timelines.append(timeline)
    (Path(args.out) / "offline_steps.json").write_text(json.dumps(timelines))
    del runner
    torch.cuda.empty_cache()
    return runs


class OfflineWorker:
    """An :class:`OfflineRunner` in a process of its own beside the server (``--interleave``):
    each served point at rate ``inf`` is followed by an offline run, so that both sides of each
    pair see the host at the same speed. It starts after the server, so that the server's share
    of GPU memory is already taken when it sizes its KV cache."""

    def __init__(self, model_dir: Path, argv: list[str]) -> None:
        # a Triton cache of its own: its kernels are not the server's (counted while serving)
        env = {**os.environ, "TRITON_CACHE_DIR": str(Path(os.environ["TRITON_CACHE_DIR"]).with_name("triton-offline"))}
        self.proc = subprocess.Popen([sys.executable, __file__, "--offline-worker", str(model_dir), *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()  # "ready"

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the offline worker exited")
            if line.startswith("{"):
                return json.loads(line)
            print(line, end="", flush=True)

    def run(self, rep: int) -> tuple[float, int, list]:
        self.proc.stdin.write(f"{rep}\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["tok_s"], r["steps"], r["timeline"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def offline_worker_main(model_dir: Path, args) -> int:
    runner = OfflineRunner(model_dir, args)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        tok_s, steps, timeline = runner.run(int(line))
        print(json.dumps({"tok_s": tok_s, "steps": steps, "timeline": timeline}), flush=True)
    return 0


def main() -> int:
    from gpu_build_startup import make_model_dir
    from serving_vs_llamacpp import server

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--rates", default="8,32,128,inf", help="request rates, req/s")
    ap.add_argument("--prompts-per-point", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the same workload offline (LLM.generate, same engine settings) "
                         "after the server stops: the served/offline ratio at saturation")
    ap.add_argument("--server-args", default="", help="more `tianxia serve` arguments, e.g. "
                    "'--max-waiting-steps 0'")
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="a Qwen2.5 tokenizer saved with save_pretrained (the random workload needs "
                         "whole-word tokens)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request, served and offline (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the rate `inf` point and the offline run this many times each "
                         "(prompts of their own every time) and compare the best of each: a lent "
                         "host's speed drifts by tens of percent between runs a minute apart")
    ap.add_argument("--interleave", action="store_true",
                    help="run the offline engine in a process of its own beside the server (each "
                         "taking part of the GPU's memory) and follow each served point at rate "
                         "`inf` with an offline run: pairs measured a few seconds apart, not "
                         "minutes (summary: the median of the pairs' ratios)")
    ap.add_argument("--offline-worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                    help="record each server process's stacks with py-spy at every rate, into DIR")
    ap.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                    help="at most N requests in flight (a closed loop: each end sends the next), so "
                         "that a point at rate `inf` measures the serving loop at saturation, not "
                         "the API process's admission of every request at once")
    ap.add_argument("--step-log", action="store_true",
                    help="the server logs every engine step (--log-level debug); each served point's "
                         "steps go to served_steps.json, as offline_steps.json has the offline runs'")
    args = ap.parse_args()
    if args.offline_worker is not None:
        return offline_worker_main(args.offline_worker, args)
    if args.interleave and not args.offline:
        ap.error("--interleave runs the offline side: drop --no-offline")
    # a timeout's SIGTERM unwinds through the `with server(...)` below, so the server stops too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tx-serve-"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))  # the servers' kernels, counted
    md = ["| shape | rate (req/s) | requests/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed |",
          "|---|---|---|---|---|---|---|"]
    summary: dict = {}
    for shape in args.shapes:
        t0 = time.perf_counter()
        d = make_model_dir(root, shape, args.tokenizer_dir)
        print(f"{shape}: saved in {time.perf_counter() - t0:.1f} s", flush=True)
        serve = [sys.executable, "-m", "tianxia.cli", "serve", str(d), "--host", "127.0.0.1",
                 "--port", str(args.port), "--served-model-name", shape, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-model-len", "2048", "--gpu-memory-utilization", "0.4" if args.interleave else "0.85",
                 "--disable-log-stats", "--disable-access-log", *args.server_args.split()]
        if args.step_log:
            serve += ["--log-level", "debug"]
        log_path = out / f"server_{shape}.log"
        served_timelines: list[list[tuple]] = []
        res_path = out / f"serve_{shape}.json"
        bench = [sys.executable, "-m", "tianxia.cli", "bench", "sweep", "--base-url",
                 f"http://127.0.0.1:{args.port}", "--model", shape, "--tokenizer", str(d),
                 "--input-len", "128", "--output-len", "64",
                 "--num-prompts", str(args.prompts_per_point), "--warmup", "8", "--no-progress",
                 "--temperature", str(args.temperature), "--extra-body", json.dumps({"top_p": args.top_p})]
        if args.max_concurrency:
            bench += ["--max-concurrency", str(args.max_concurrency)]
        t0 = time.monotonic()
        with server(serve, args.port, log_path, timeout=420.0) as base:
            startup = time.monotonic() - t0
            kernels = triton_cache_entries()
            points, cpu, rc = [], {}, 0
            worker = pairs = None
            if args.interleave:
                worker = OfflineWorker(d, ["--max-num-seqs", str(args.max_num_seqs), "--prompts-per-point",
                                           str(args.prompts_per_point), "--temperature", str(args.temperature),
                                           "--top-p", str(args.top_p), "--out", str(out)])
                pairs, timelines = [], []
            rates = [r for rate in args.rates.split(",")
                     for r in ([rate] * args.repeats if rate == "inf" else [rate])]
            for k, rate in enumerate(rates):
                # one bench per rate, so that each point's CPU use per process is its own
                part = out / f"serve_{shape}_rate{rate}.json"
                before = served_steps(base)
                log_offset = log_path.stat().st_size if args.step_log else 0
                with CpuSampler() as sampler, QueueSampler(base, args.max_num_seqs) as queue, \
                        StackSampler(args.py_spy, f"{shape}_rate{rate}_{k}"):
                    # prompts of their own at each rate: none hits the prefix cache that an
                    # earlier rate filled (the offline run, its ceiling, computes every prompt)
                    r = subprocess.run(bench + ["--request-rates", rate, "--seed", str(k), "--save-result", str(part)],
                                       capture_output=True, text=True)
                after = served_steps(base)  # the bench's warm-up requests included
                delta = {name: after[name] - before[name] for name in after}
                steps, busy = delta["steps"], delta["busy_s"]
                rc = rc or r.returncode
                print(r.stdout[-3000:], r.stderr[-2000:], flush=True)
                if part.is_file():
                    new = json.loads(part.read_text())["points"]
                    points += new
                    part.unlink()
                    if new:
                        again = rates[:k].count(rate)
                        key = f"{rate}#{again + 1}" if again else rate
                        cpu[key] = sampler.busiest(new[0]["summary"]["duration_s"])
                        new[0]["engine_steps"] = steps
                        new[0]["engine_busy_s"] = round(busy, 3)  # the time in steps
                        print(f"  rate {rate}: {steps:.0f} engine steps, {1000 * busy / max(steps, 1):.2f} ms a "
                              f"step; in steps {busy:.2f} s of {new[0]['summary']['duration_s']:.2f} s", flush=True)
                        new[0]["engine_step_seqs"] = delta["seqs"]
                        new[0]["engine_step_tokens"] = delta["tokens"]
                        print(f"  rate {rate}: " + step_sizes(steps, delta["seqs"], delta["tokens"],
                                                             delta["half_full"]), flush=True)
                        if args.step_log:
                            log = log_since(log_path, log_offset)
                            served_timelines.append(logged_steps(log))
                            print(f"  rate {rate}: " + small_steps_line(served_timelines[-1]), flush=True)
                            a = new[0]["admission"] = steps_after(log, new[0]["start_monotonic_s"])
                            print(f"  rate {rate}: " + (
                                f"first step {a['first_step_s']:.3f} s after the bench's start, first step "
                                f"of {a['largest_step_seqs']} sequences at {a['largest_step_s']:.3f} s"
                                if a else "no step after the bench's start"), flush=True)
                        new[0]["engine_queue"] = queue.summary()
                        print(f"  rate {rate}: " + queue_line(new[0]["engine_queue"]), flush=True)
                        print(f"  rate {rate}: share of a core per process {cpu[key]}", flush=True)
                        if worker is not None and rate == "inf":
                            tok_s, off_steps, timeline = worker.run(k)
                            pairs.append((new[0]["summary"]["output_throughput"], tok_s, off_steps))
                            timelines.append(timeline)
                            print(f"  pair {len(pairs)}: served/offline {pairs[-1][0] / tok_s:.3f}", flush=True)
            if served_timelines:
                (out / "served_steps.json").write_text(json.dumps(served_timelines))
            if worker is not None:
                worker.close()
                (out / "offline_steps.json").write_text(json.dumps(timelines))
            res_path.write_text(json.dumps({"points": points}, indent=1))
            # kernels the server compiled while serving (each a stall of a step): should be none
            compiled = triton_cache_entries() - kernels
        summary[shape] = {"server_start_s": round(startup, 1), "bench_rc": rc, "cpu_share": cpu,
                          "triton_kernels_compiled_while_serving": sorted(k.split("/")[1] for k in compiled)}
        if pairs:
            runs = [(tok_s, steps) for _, tok_s, steps in pairs]
            ratios = [served / tok_s for served, tok_s, _ in pairs]
            summary[shape]["interleaved_pair_ratios"] = [round(r, 3) for r in ratios]
            summary[shape]["median_pair_ratio"] = round(statistics.median(ratios), 3)
        elif args.offline:
            runs = offline_throughput(d, args)
        if args.offline:
            best_tok_s, steps = max(runs)
            summary[shape]["offline_output_tok_s"] = round(best_tok_s, 1)
            summary[shape]["offline_engine_steps"] = steps
            summary[shape]["offline_runs_tok_s"] = [round(t, 1) for t, _ in runs]
            print(f"{shape}: offline {summary[shape]['offline_output_tok_s']} output tok/s", flush=True)
        if args.offline and points:
            # best against best: each the run the host slowed least
            best = max(pt["summary"]["output_throughput"] for pt in points)
            summary[shape]["served_over_offline"] = round(best / summary[shape]["offline_output_tok_s"], 3)
            saturated = [pt["summary"]["output_throughput"] for pt in points if pt["load"] == float("inf")]
            if saturated:
                summary[shape]["served_inf_runs_tok_s"] = [round(t, 1) for t in saturated]
                summary[shape]["median_served_over_median_offline"] = round(
                    statistics.median(saturated) / statistics.median(t for t, _ in runs), 3)
        for pt in points:
            s = pt["summary"]
            md.append(f"| {shape} | {pt['load']} | {s['request_throughput']:.1f} | {s['output_throughput']:.0f} | "
                      f"{s['ttft_ms']['median']:.1f} / {s['ttft_ms']['p99']:.1f} | "
                      f"{s['tpot_ms']['median']:.2f} / {s['tpot_ms']['p99']:.2f} | {s['failed']} |")
    text = "\n".join(md) + "\n\n" + json.dumps(summary) + "\n"
    (out / "gpu_serving.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
