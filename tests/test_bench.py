"""``tianxia bench``: against a real ``tianxia serve`` on 127.0.0.1, every metric re-derived from
independent accounting (the server's ``usage`` and ``/metrics``, our tokenizer, the per-request
timestamps); failing targets are counted, not crashed on; ``compare`` and ``--plot`` write files.
A stdlib fake server covers the "unknown field" retry path."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from tianxia.bench.metrics import RequestRecord, peak_concurrency, summarize
from tianxia.bench.report import compare_markdown, load_result
from tianxia.bench.runner import WorkloadConfig, build_workload, run_serve, run_sweep
from tianxia.bench.serve import ClientConfig, arrival_delays
from tianxia.bench.workloads import LenSpec, file_workload, parse_len, word_sampler
from tianxia.cli import main as tianxia_main

TIANXIA = [sys.executable, "-m", "tianxia.cli"]
MODEL = "smollm2-135m"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(base: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (sums by bare name as well)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _delta(after: dict, before: dict, key: str) -> float | None:
    return after[key] - before.get(key, 0.0) if key in after else None


@pytest.fixture(scope="module")
def server(smollm2_path):
    """A real ``tianxia serve`` on a free local port, for this module."""
    port = _free_port()
    env = dict(os.environ, TIANXIA_API_KEY="")
    proc = subprocess.Popen(
        TIANXIA + ["serve", MODEL, "--host", "127.0.0.1", "--port", str(port), "--threads", "2",
                   "--max-num-seqs", "8", "--kv-cache-memory", "128MiB", "--max-model-len", "512",
                   "--disable-log-stats", "--disable-access-log", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tianxia serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("tianxia serve did not become healthy in 240 s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from tianxia.loader.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path, is_gguf=True)


@pytest.fixture(scope="module")
def serve_run(server, tmp_path_factory):
    """``tianxia bench serve`` as a real CLI run: 6 prompts of 32 tokens, 12 out, 3 at a time."""
    out = tmp_path_factory.mktemp("bench")
    before = _scrape(server)
    t0, mono0 = time.perf_counter(), time.monotonic()
    r = subprocess.run(  # noqa: PLW1510 - the return code is asserted
        TIANXIA + ["bench", "serve", "--base-url", server, "--model", MODEL,
                   "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "32",
                   "--output-len", "12", "--warmup", "0", "--label", "tianxia", "--save-text",
                   "--save-result", str(out / "run.json"), "--plot", str(out / "run.png")],
        capture_output=True, text=True, timeout=300)
    wall, mono1 = time.perf_counter() - t0, time.monotonic()
    after = _scrape(server)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"stdout": r.stdout, "stderr": r.stderr, "wall": wall, "dir": out, "monotonic": (mono0, mono1),
            "result": json.loads((out / "run.json").read_text()), "before": before, "after": after}


# ----------------------------------------------------------------------------- real server


def test_serve_metrics_match_independent_accounting(serve_run, tokenizer):
    res = serve_run["result"]
    s, reqs = res["summary"], res["requests"]
    assert res["schema"] == "tianxia.bench.serve/1"
    assert res["notes"] == []  # ignore_eos and min_tokens accepted, nothing short
    # where start_s counts from, on the host's monotonic clock (what a server logs its times on)
    mono0, mono1 = serve_run["monotonic"]
    assert mono0 < res["start_monotonic_s"] < res["start_monotonic_s"] + res["summary"]["duration_s"] < mono1
    # request count
    assert s["num_requests"] == len(reqs) == 6 and s["completed"] == 6 and s["failed"] == 0
    assert sorted(r["index"] for r in reqs) == list(range(6))
    for r in reqs:
        assert r["success"] and r["error"] is None and r["http_status"] == 200
        # exact lengths asked and got, per the server's usage
        assert r["expected_input_tokens"] == 32
        assert r["usage_prompt_tokens"] in (32, 33)  # a BOS may be added
        assert r["input_tokens"] == r["usage_prompt_tokens"]
        assert r["usage_completion_tokens"] == r["output_tokens"] == 12
        assert r["output_tokens_source"] == "usage" and r["finish_reason"] == "length"
        # our own count of the streamed text agrees (re-tokenizing may merge a few tokens)
        assert r["counted_output_tokens"] == len(tokenizer(r["text"], add_special_tokens=False)["input_ids"])
        assert 0.5 * 12 <= r["counted_output_tokens"] <= 12
        assert 1 <= r["num_chunks"] <= 12 and len(r["itl_s"]) == r["num_chunks"] - 1
        # timing consistency: TTFT <= E2E, first chunk + gaps = last chunk <= end of stream
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["ttft_s"] + sum(r["itl_s"]) <= r["e2e_s"] + 1e-6
        assert all(g >= 0 for g in r["itl_s"])
        assert math.isclose(r["tpot_s"], (r["e2e_s"] - r["ttft_s"]) / 11, rel_tol=1e-9)
    # totals and throughputs from the per-request records
    dur = max(r["start_s"] + r["e2e_s"] for r in reqs)
    assert math.isclose(s["duration_s"], dur, rel_tol=1e-9)
    assert s["duration_s"] < serve_run["wall"]
    assert s["total_output_tokens"] == 72 and s["total_expected_output_tokens"] == 72
    assert s["total_input_tokens"] == sum(r["usage_prompt_tokens"] for r in reqs)
    assert math.isclose(s["output_throughput"], 72 / dur, rel_tol=1e-9)
    assert math.isclose(s["request_throughput"], 6 / dur, rel_tol=1e-9)
    assert math.isclose(s["total_token_throughput"], (72 + s["total_input_tokens"]) / dur, rel_tol=1e-9)
    # percentiles
    ttfts = [r["ttft_s"] * 1000 for r in reqs]
    assert math.isclose(s["ttft_ms"]["median"], statistics.median(ttfts), rel_tol=1e-9)
    assert math.isclose(s["ttft_ms"]["mean"], statistics.fmean(ttfts), rel_tol=1e-9)
    assert s["ttft_ms"]["min"] <= s["ttft_ms"]["median"] <= s["ttft_ms"]["p90"] <= \
        s["ttft_ms"]["p99"] <= s["ttft_ms"]["max"] == max(ttfts)
    itls = [g * 1000 for r in reqs for g in r["itl_s"]]
    assert s["itl_ms"]["count"] == len(itls)
    assert math.isclose(s["itl_ms"]["mean"], statistics.fmean(itls), rel_tol=1e-9)
    assert math.isclose(s["e2el_ms"]["max"], max(r["e2e_s"] for r in reqs) * 1000, rel_tol=1e-9)
    assert s["tpot_ms"]["count"] == 6
    # peak concurrency: brute force over every send time; capped at --max-concurrency 3
    brute = max(sum(1 for q in reqs if q["start_s"] <= r["start_s"] < q["start_s"] + q["e2e_s"])
                for r in reqs)
    assert s["peak_concurrency"] == brute == 3
    # the server's own counters (vLLM-style /metrics) saw the same requests and tokens
    before, after = serve_run["before"], serve_run["after"]
    gen = _delta(after, before, "vllm:generation_tokens_total")
    if gen is not None:
        assert gen == 72
    ok = _delta(after, before, "vllm:request_success_total")
    if ok is not None:
        assert ok == 6


def test_serve_prints_table_and_plots(serve_run):
    out = serve_run["stdout"]
    for needle in ("Successful requests:", "Failed requests:", "Request throughput (req/s):",
                   "Output token throughput (tok/s):", "Peak concurrent requests:",
                   "Median TTFT (ms):", "P99 TPOT (ms):", "P90 ITL (ms):", "Mean E2EL (ms):"):
        assert needle in out
    png = (serve_run["dir"] / "run.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 20_000
    assert "6/6" in serve_run["stderr"]  # the progress bar


def test_chat_endpoint_with_poisson_arrivals(server, tokenizer):
    wl = WorkloadConfig(name="prefix", input_len=LenSpec(8, 16), output_len=LenSpec(6, 6),
                        prefix_len=48)
    reqs = build_workload(wl, tokenizer, 4, seed=3, endpoint="chat")
    client = ClientConfig(base_url=server + "/v1", model=MODEL, endpoint="chat", request_rate=8.0,
                          seed=3)
    res = run_serve(client, reqs, tokenizer=tokenizer, workload=wl, progress=False, warmup=1)
    s = res["summary"]
    assert s["completed"] == 4 and s["failed"] == 0
    for r in res["requests"]:
        # expected = our tokenizer's count after the model's chat template
        assert r["usage_prompt_tokens"] == r["expected_input_tokens"] > 48
        assert r["output_tokens"] == 6 and r["ttft_s"] <= r["e2e_s"]
    assert res["config"]["request_rate"] == 8.0 and res["config"]["endpoint"] == "chat"


def test_multi_turn_conversations_extend_their_history(server, tokenizer):
    """3 conversations x 2 turns over 2 system prompts, chat: each turn carries the earlier turns
    and the server's own replies (its prompt tokens are our tokenizer's count of exactly that
    conversation under the chat template), is sent after the last reply, and hits the prefix
    cache for the last turn's prompt; the hit rate is the server's ``/metrics`` counter."""
    wl = WorkloadConfig(name="multi-turn", input_len=LenSpec(8, 8), output_len=LenSpec(5, 5),
                        prefix_len=40, num_prefixes=2, num_turns=2)
    reqs = build_workload(wl, tokenizer, 6, seed=5, endpoint="chat")
    assert [(r.conversation, r.turn) for r in reqs[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert reqs[0].system == reqs[4].system != reqs[2].system  # conversations 0 and 2 share one
    before = _scrape(server)
    client = ClientConfig(base_url=server, model=MODEL, endpoint="chat", max_concurrency=3,
                          save_text=True)
    res = run_serve(client, reqs, tokenizer=tokenizer, workload=wl, progress=False, warmup=0)
    after = _scrape(server)
    s, rows = res["summary"], res["requests"]
    assert s["completed"] == 6 and s["failed"] == 0
    assert res["config"]["workload"]["num_turns"] == 2
    for conv in range(3):
        turns = rows[2 * conv: 2 * conv + 2]
        messages = [{"role": "system", "content": reqs[2 * conv].system}]
        for k, r in enumerate(turns):
            messages.append({"role": "user", "content": reqs[2 * conv + k].prompt})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert r["usage_prompt_tokens"] == len(ids)
            messages.append({"role": "assistant", "content": r["text"]})
            if k:
                last = turns[k - 1]
                assert r["start_s"] >= last["start_s"] + last["e2e_s"]
                # at least every full block of the last turn's prompt is reused
                assert r["usage_cached_tokens"] >= last["usage_prompt_tokens"] // 16 * 16 - 16
    cached = sum(r["usage_cached_tokens"] for r in rows)
    assert s["total_cached_tokens"] == cached > 0
    assert s["cache_hit_rate"] == pytest.approx(cached / s["total_input_tokens"])
    assert _delta(after, before, "vllm:prefix_cache_hits_total") == cached
    row = compare_markdown([dict(res, label="mt")]).splitlines()
    assert "cache hit %" in row[0] and f"| {100 * s['cache_hit_rate']:.1f} |" in row[2]
    # completions: each turn's prompt text is the last one's plus its reply
    reqs = build_workload(wl, tokenizer, 2, seed=6, endpoint="completions")
    client = ClientConfig(base_url=server, model=MODEL, save_text=True)
    res = run_serve(client, reqs, tokenizer=tokenizer, workload=wl, progress=False, warmup=0)
    first, second = res["requests"]
    again = dataclasses.replace(reqs[1], history=[(reqs[0].prompt, first["text"])])
    assert again.completion_prompt().startswith(reqs[0].completion_prompt() + first["text"])
    assert second["usage_prompt_tokens"] > first["usage_prompt_tokens"] + 8
    assert second["usage_cached_tokens"] >= first["usage_prompt_tokens"] // 16 * 16 - 16


def test_failures_are_counted_not_raised(server, tmp_path, capsys):
    # an unknown model: every request answered 404, counted with its message
    before = _scrape(server)
    reqs = [_tiny_request(i) for i in range(3)]
    res = run_serve(ClientConfig(base_url=server, model="no-such-model", max_concurrency=2), reqs,
                    progress=False, warmup=0)
    s = res["summary"]
    assert s["completed"] == 0 and s["failed"] == 3 and s["total_output_tokens"] == 0
    assert all(r["http_status"] == 404 for r in res["requests"])
    (msg, n), = s["errors"].items()
    assert n == 3 and msg.startswith("HTTP 404") and "no-such-model" in msg
    assert s["ttft_ms"]["median"] is None and s["request_throughput"] == 0
    after = _scrape(server)
    key = next((k for k in after if k.startswith("tianxia:http_requests_total{")
                and 'status="404"' in k and "completions" in k), None)
    if key is not None:
        assert _delta(after, before, key) == 3
    # nothing listening: connection errors, through the CLI: the table, the result file and the
    # plot are written, and since no request succeeded the exit status is 1 (vLLM's benchmark
    # fails too), with the first error
    port = _free_port()
    out = tmp_path / "dead.json"
    rc = tianxia_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", MODEL,
                       "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                       "--no-progress", "--save-result", str(out), "--plot", str(tmp_path / "dead.png")])
    assert rc == 1
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 0 and s["failed"] == 4
    assert sum(s["errors"].values()) == 4 and "Connect" in next(iter(s["errors"]))
    captured = capsys.readouterr()
    assert "Failed requests:" in captured.out and "ClientConnectorError" in captured.out
    assert "no request succeeded (4 failed); the first error: ClientConnectorError" in captured.err
    assert (tmp_path / "dead.png").read_bytes()[:8] == PNG_MAGIC


def test_sweep_finds_highest_load_within_slo(server, tokenizer, tmp_path):
    from tianxia.bench.plot import plot_sweep

    wl = WorkloadConfig(input_len=LenSpec(16, 16), output_len=LenSpec(4, 4))
    reqs = build_workload(wl, tokenizer, 4, seed=0, endpoint="completions")
    client = ClientConfig(base_url=server, model=MODEL)
    sweep = run_sweep(client, reqs, kind="concurrency", loads=[1, 2], prompts_for=lambda c: 2 * int(c),
                      slo_p99={"ttft": 60.0, "tpot": 60.0}, tokenizer=tokenizer, workload=wl,
                      progress=False, warmup=0)
    assert [p["load"] for p in sweep["points"]] == [1, 2]
    assert [p["summary"]["completed"] for p in sweep["points"]] == [2, 4]
    assert all(p["meets_slo"] for p in sweep["points"]) and sweep["best_load"] == 2
    assert sweep["points"][1]["summary"]["peak_concurrency"] <= 2
    # each point's start on the monotonic clock, the second after the first has ended
    first, second = sweep["points"]
    assert first["start_monotonic_s"] + first["summary"]["duration_s"] < second["start_monotonic_s"] < time.monotonic()
    # the same points against an impossible SLO: nothing qualifies
    from tianxia.bench.metrics import slo_report

    assert not slo_report(sweep["points"][0]["summary"], {"ttft": 1e-6})[0]
    png = plot_sweep(sweep, tmp_path / "sweep.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    md = compare_markdown([load_result(tmp_path / "sweep.json")])
    assert md.count("\n") == 3  # header, rule, two points


def test_compare_writes_table_and_plot(serve_run, tmp_path, capsys):
    a = serve_run["result"]
    b = json.loads(json.dumps(a))
    b["label"] = "other"
    b["summary"]["output_throughput"] = a["summary"]["output_throughput"] / 2
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    rc = tianxia_main(["bench", "compare", str(pa), str(pb), "-o", str(tmp_path / "c.md"),
                       "--plot", str(tmp_path / "c.png")])
    assert rc == 0
    md = (tmp_path / "c.md").read_text()
    assert md.strip() == capsys.readouterr().out.strip()
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len(lines) == 4 and "tianxia" in lines[2] and "other" in lines[3]
    assert "out tok/s vs tianxia" in lines[0] and "0.50x" in lines[3] and "1.00x" in lines[2]
    png = (tmp_path / "c.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert tianxia_main(["bench", "compare", str(bad)]) == 1
    assert capsys.readouterr().err.startswith("error:")


# ----------------------------------------------------------------------------- no server


class _Recording(BaseHTTPRequestHandler):
    """A local stand-in server that keeps the JSON body of every request it reads."""

    bodies: ClassVar[list[dict]] = []

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.bodies = []  # each stand-in its own, not the base class's shared list

    def log_message(self, *a):
        pass

    def read_body(self) -> dict:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        return body


class _FakeOpenAI(_Recording):
    """Streams ``max_tokens`` chunks; rejects the fields in ``reject`` like a strict server."""

    protocol_version = "HTTP/1.0"
    reject: ClassVar[set[str]] = set()

    def do_POST(self):
        body = self.read_body()
        bad = sorted(k for k in self.reject if k in body)
        if bad:
            self.send_response(422)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"detail": [{"loc": ["body", bad[0]],
                                                     "msg": "Extra inputs are not permitted"}]}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices":[{"text":" a","finish_reason":null}]}\n\n')
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")  # no usage: counted by the tokenizer / chunks


def test_rejected_extra_fields_are_retried_without_them(tokenizer):
    _FakeOpenAI.reject, _FakeOpenAI.bodies = {"min_tokens"}, []
    res = _one_at_a_time(_FakeOpenAI, [_tiny_request(i, out=5) for i in range(3)], tokenizer)
    s = res["summary"]
    assert s["completed"] == 3 and s["failed"] == 0
    assert any("min_tokens" in n for n in res["notes"])
    assert res["requests"][0]["dropped_fields"] == ["min_tokens"]
    assert res["requests"][1]["dropped_fields"] == []  # later requests leave it out at once
    assert len(_FakeOpenAI.bodies) == 4 and "min_tokens" not in _FakeOpenAI.bodies[-1]
    assert _FakeOpenAI.bodies[-1]["ignore_eos"] is True
    for r in res["requests"]:  # no usage: our tokenizer counted " a a a a a"
        assert r["output_tokens_source"] == "tokenizer" and r["output_tokens"] == 5


class _ClosesKeptAlive(_Recording):
    """Answers each request on a connection it says it keeps alive, then closes that connection as
    soon as the next request arrives on it, unanswered: what llama-server's HTTP library does with
    a connection whose streamed response outlived its keep-alive timeout."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.read_body()
        data = b"".join(b'data: {"choices":[{"text":" a","finish_reason":null}]}\n\n'
                        for _ in range(body["max_tokens"])) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Keep-Alive", "timeout=5, max=100")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        select.select([self.connection], [], [], 5.0)  # the next request (or the client's close)
        self.close_connection = True


def test_request_on_a_connection_the_server_closed_is_sent_again(tokenizer):
    _ClosesKeptAlive.bodies = []
    res = _one_at_a_time(_ClosesKeptAlive, [_tiny_request(i, out=3) for i in range(4)], tokenizer)
    s = res["summary"]
    assert s["completed"] == 4 and s["failed"] == 0, s["errors"]
    # requests 1 and 3 went first on the connection kept from the request before them
    assert any(n.startswith("2 request(s) sent again on a new connection") for n in res["notes"])
    assert len(_ClosesKeptAlive.bodies) == 4  # each answered once
    assert all(r["output_tokens"] == 3 for r in res["requests"])


def _one_at_a_time(handler: type[BaseHTTPRequestHandler], reqs: list, tokenizer) -> dict:
    """``reqs`` sent one at a time to a local server of ``handler``."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        return run_serve(ClientConfig(base_url=f"http://127.0.0.1:{srv.server_port}", model="x",
                                      max_concurrency=1), reqs, tokenizer=tokenizer,
                         progress=False, warmup=0)
    finally:
        srv.shutdown()


def _tiny_request(i: int, out: int = 4):
    from tianxia.bench.workloads import BenchRequest

    return BenchRequest(i, "Hello there, how are you", out, input_len=6)


def test_arrivals_lengths_and_durations():
    from tianxia.bench.cli import parse_duration

    assert arrival_delays(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_delays(4, 2.0, math.inf, 0) == [0.0, 0.5, 0.5, 0.5]
    for b in (1.0, 0.5, 4.0):
        d = arrival_delays(4001, 10.0, b, 1)[1:]
        mean = statistics.fmean(d)
        assert abs(mean - 0.1) < 0.01
        cv2 = statistics.pvariance(d) / mean**2  # gamma: CV^2 = 1 / shape
        assert abs(cv2 - 1 / b) < 0.25 / b
    assert arrival_delays(5, 3.0, 1.0, 7) == arrival_delays(5, 3.0, 1.0, 7)
    assert parse_len("128") == LenSpec(128, 128) and parse_len("96:160") == LenSpec(96, 160)
    assert parse_len("5-9") == LenSpec(5, 9)
    with pytest.raises(ValueError):
        parse_len("9:5")
    assert parse_duration("1s") == 1.0 and parse_duration("100ms") == 0.1
    assert parse_duration("250") == 0.25
    assert peak_concurrency([(0, 1), (1, 2), (0.5, 1.5)]) == 2
    assert peak_concurrency([]) == 0


def test_summary_of_mixed_records():
    recs = [RequestRecord(0, success=True, start_s=0.0, ttft_s=0.1, e2e_s=1.1, itl_s=[0.5, 0.5],
                          num_chunks=3, output_tokens=3, input_tokens=10),
            RequestRecord(1, success=False, error="HTTP 500: boom", start_s=0.5, e2e_s=0.1)]
    s = summarize(recs, 1.1, slo={"ttft": 0.2, "tpot": 0.4})
    assert s["completed"] == 1 and s["failed"] == 1 and s["errors"] == {"HTTP 500: boom": 1}
    assert s["tpot_ms"]["mean"] == pytest.approx(500.0) and s["peak_concurrency"] == 2
    assert s["good_requests"] == 0  # TPOT 0.5 s > 0.4 s
    assert s["output_throughput"] == pytest.approx(3 / 1.1)


def test_workloads_exact_lengths_and_files(tokenizer, tmp_path):
    import random

    ws = word_sampler(tokenizer)
    rng = random.Random(0)
    for n in (1, 7, 128, 300):
        assert ws.count(ws.text(n, rng)) == n
    reqs = build_workload(WorkloadConfig(input_len=LenSpec(20, 40)), tokenizer, 5, 1, "completions")
    assert all(20 <= r.input_len <= 40 and ws.count(r.prompt) == r.input_len for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in build_workload(
        WorkloadConfig(input_len=LenSpec(20, 40)), tokenizer, 5, 1, "completions")]
    pre = build_workload(WorkloadConfig(name="prefix", prefix_len=32, input_len=LenSpec(8, 8)),
                         tokenizer, 3, 0, "completions")
    assert len({r.system for r in pre}) == 1 and ws.count(pre[0].system) == 32
    sharegpt = [{"conversations": [{"from": "human", "value": "What is the capital of France?"},
                                   {"from": "gpt", "value": "The capital of France is Paris, a city."}]},
                {"conversations": [{"from": "gpt", "value": "no user turn"}]}]
    (tmp_path / "sg.json").write_text(json.dumps(sharegpt))
    got = file_workload(tmp_path / "sg.json", tokenizer, 3, None, 0)
    ref = len(tokenizer("The capital of France is Paris, a city.", add_special_tokens=False)["input_ids"])
    assert len(got) == 3 and all(r.output_len == ref for r in got)
    assert got[0].chat_messages() == [{"role": "user", "content": "What is the capital of France?"}]
    (tmp_path / "p.jsonl").write_text('{"prompt": "one", "output_len": 3}\n"two"\n')
    got = file_workload(tmp_path / "p.jsonl", tokenizer, 2, parse_len("9"), 0)
    assert sorted(r.prompt for r in got) == ["one", "two"] and {r.output_len for r in got} == {9}
    with pytest.raises(ValueError):
        file_workload(tmp_path / "missing.json", tokenizer, 1, None, 0)
    with pytest.raises(ValueError, match="tokenizer"):
        build_workload(WorkloadConfig(), None, 1, 0, "completions")


def test_bench_cli_help_and_errors(capsys):
    with pytest.raises(SystemExit) as e:
        tianxia_main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(w in out for w in ("serve", "sweep", "compare")), out
    rc = tianxia_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "nope-model",
                       "--num-prompts", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("error:") and "--tokenizer" in err[-1]
