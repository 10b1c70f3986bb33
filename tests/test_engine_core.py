"""The engine core in its own process (``--engine-core process``, ``--data-parallel-size``).

Real servers, real processes, the ``openai`` client: the same greedy text as the offline engine,
a disconnect that frees the request's KV blocks, SIGTERM draining, a killed core ending the
requests in flight and the server (exit 1 within 5 s), a SIGKILLed server taking its core with
it, and two data-parallel cores that both serve, agree with one, and route by prefix.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from tianxia import SamplingParams
from tianxia.server.testing import ServerProcess, metric

MODEL = "smollm2-135m"
ARGS = [MODEL, "--engine-core", "process", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
        "--cpu-activations", "float32"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


def core_pids(srv: ServerProcess) -> list[int]:
    return [int(p) for p in re.findall(r"engine core \d+: process (\d+)", srv.log())]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by a dead parent's init) counts as gone once all its
    # threads have exited: the leader turns zombie first, and the others close the process's
    # files (its listening socket) after
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] != "Z":
                return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except FileNotFoundError:  # reaped meanwhile
        return False


def wait_until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout}s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def sigkill_server(srv: ServerProcess, pids: list[int], timeout: float) -> None:
    """SIGKILL the server's own process and wait until every one of ``pids`` (its API servers,
    its cores) has exited too: none may outlive it as an orphan."""
    srv.signal(signal.SIGKILL)
    srv.wait(10)
    wait_until(lambda: not any(alive(p) for p in pids), timeout, "no orphan left")


def environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(v.decode().partition("=")[::2] for v in f.read().split(b"\0") if v)


def greedy_texts(url: str, max_tokens: int = 12) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    out: list[str] = [""] * len(PROMPTS)

    def one(i: int) -> None:  # concurrently, so they share steps
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens,
                                      temperature=0)
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def offline_texts(smollm2_llm):
    outs = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    return [o.outputs[0].text for o in outs]


# and with async scheduling (on by default on a GPU), whose steps are launched before the
# previous step's tokens are read
@pytest.mark.parametrize("scheduling", [[], ["--async-scheduling"]], ids=["plain", "async"])
def test_core_process_serves_frees_on_disconnect_and_drains(offline_texts, scheduling):
    srv = ServerProcess([*ARGS, *scheduling, "--shutdown-timeout", "300"]).start()  # drains on a loaded CPU
    try:
        (pid,) = core_pids(srv)
        assert alive(pid) and pid != srv.proc.pid
        assert ("async scheduling:" in srv.log()) == bool(scheduling)
        # the core's OpenMP threads wait briefly between steps (the API process needs those
        # CPUs then); the API process keeps the environment it was given
        assert environment(pid).get("GOMP_SPINCOUNT") == "1000"
        assert "GOMP_SPINCOUNT" not in environment(srv.proc.pid)
        # on a CPU the server is its one API process by default (no supervisor)
        assert not re.search(r"API server \d+: process", srv.log())
        assert greedy_texts(srv.url) == offline_texts

        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
            stream=True, temperature=0))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")

        # every step the core runs counts in the per-step histograms, those launched ahead too:
        # a request's prompt tokens (less the cached) and each output token but the last
        def step_tokens() -> tuple[float, float]:
            text = httpx.get(srv.url + "/metrics").text
            return (metric(text, "vllm:iteration_tokens_total_sum", model_name=MODEL),
                    metric(text, "vllm:iteration_tokens_total_count", model_name=MODEL))

        tokens_before, steps_before = step_tokens()
        usage = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "A short history of rivers:", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0}).json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        computed = usage["prompt_tokens"] - cached + usage["completion_tokens"] - 1
        wait_until(lambda: step_tokens()[0] - tokens_before == computed, 5, "the request's steps counted")
        assert step_tokens()[1] - steps_before >= usage["completion_tokens"] - 1

        # a client that leaves: its request is aborted in the core and its blocks are freed
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
        wait_until(lambda: metric(httpx.get(srv.url + "/metrics").text,
                                  "vllm:kv_cache_usage_perc", model_name=MODEL) == 0.0,
                   10, "the disconnected request's KV blocks freed")

        # SIGTERM drains: the request in flight completes, then the server and its core exit 0
        result: dict = {}

        def long_request() -> None:
            result["r"] = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Once", "max_tokens": 48, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        wait_until(lambda: (metric(httpx.get(srv.url + "/metrics").text,
                                   "vllm:num_requests_running", model_name=MODEL) or 0) > 0,
                   10, "the request running")
        srv.signal(signal.SIGTERM)
        t.join(60)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 48
        assert srv.wait(30) == 0
        wait_until(lambda: not alive(pid), 5, "the core gone after the drain")
    finally:
        srv.stop()


def test_killed_core_fails_requests_and_exits_nonzero():
    srv = ServerProcess(ARGS).start()
    try:
        (pid,) = core_pids(srv)
        events: list[str] = []
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            events = [line for line in lines if line.startswith("data: ")]
        # the stream ends with an error event (a 500-class error), not a hang or a clean finish
        assert any('"error"' in e for e in events), events[-3:]
        assert srv.wait(10) == 1
        assert time.monotonic() - killed < 5
        assert "engine core 0 exited" in srv.log()
    finally:
        srv.stop()


def test_sigkilled_server_takes_its_core_along():
    srv = ServerProcess(ARGS).start()
    try:
        sigkill_server(srv, core_pids(srv), 5)
        with socket.socket() as s:  # nothing keeps the port
            s.bind((srv.host, srv.port))
    finally:
        srv.stop()


def test_data_parallel_two_cores(offline_texts):
    srv = ServerProcess([*ARGS, "--data-parallel-size", "2", "--threads", "1"],
                        env={"OMP_WAIT_POLICY": "active"}).start()
    try:
        assert len(core_pids(srv)) == 2
        # a wait the user chose is the cores' own
        assert all("GOMP_SPINCOUNT" not in environment(pid) and
                   environment(pid)["OMP_WAIT_POLICY"] == "active" for pid in core_pids(srv))
        assert greedy_texts(srv.url) == offline_texts
        text = httpx.get(srv.url + "/metrics").text
        routed = [metric(text, "tianxia:engine_routed_requests_total", model_name=MODEL,
                         engine=str(i)) for i in (0, 1)]
        assert all(n and n > 0 for n in routed), routed  # both cores served

        # a long shared prefix (several 16-token blocks) goes back to the core that served it
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        prefix = "You are a helpful assistant who answers briefly. " * 6
        for q in ("What is 2+2?", "Name a color.", "Say yes."):
            client.completions.create(model=MODEL, prompt=prefix + q, max_tokens=2,
                                      temperature=0)
        text = httpx.get(srv.url + "/metrics").text
        by_prefix = [metric(text, "tianxia:engine_routed_by_prefix_total", model_name=MODEL,
                            engine=str(i)) for i in (0, 1)]
        assert sorted(by_prefix) == [0, 2], by_prefix
        hits = sum(metric(text, "tianxia:engine_prefix_cache_hits_total", model_name=MODEL,
                          engine=str(i)) for i in (0, 1))
        assert hits >= 2 * 16 * 2  # the two later requests took their prefix from the cache
        assert metric(text, "vllm:num_requests_running", model_name=MODEL) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size must be at least 1"),
    (["--data-parallel-size", "2", "--engine-core", "thread"],
     "--data-parallel-size needs --engine-core process"),
])
def test_bad_engine_core_flags_are_one_line_errors(flags, message):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tianxia.cli", "serve", MODEL, *flags],
                       capture_output=True, text=True, timeout=120, check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr


def test_core_sends_one_message_a_step(smollm2_llm):
    """Each step's tokens and statistics leave the core as one message; a turn of its loop that
    took no command and changed no statistic sends none. (A statistics-only message after every
    step had doubled the messages, and each API process's wake-ups, at concurrency 1.)"""
    import zmq

    from tianxia.engine import core_messages as msgs
    from tianxia.engine.core_proc import EngineCore

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://core-outputs")
    push.connect("inproc://core-outputs")
    core = EngineCore(smollm2_llm.engine, [push], log_stats_interval=None)
    thread = core.run_thread()
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    try:
        core.handle(["add", "r0", PROMPTS[0], msgs.params_fields(params), time.monotonic(), None, 0])
        messages: list[msgs.Outputs] = []
        while not any(o.finished for m in messages for o in m.outputs):
            assert pull.poll(60_000), "no message from the core within 60 s"
            messages.append(msgs.from_core.decode(pull.recv()))
        time.sleep(0.5)  # nothing more may follow a finished, idle request's last step
        while pull.poll(0):
            messages.append(msgs.from_core.decode(pull.recv()))
    finally:
        core.handle(["shutdown"])
        thread.join(30)
        pull.close(0)
        push.close(0)
        ctx.term()
    with_tokens = [m for m in messages if m.outputs]
    assert sum(len(c.new_token_ids) for m in with_tokens for o in m.outputs for c in o.choices) == 24
    assert [a[0] for m in messages for a in m.acks] == ["r0"]
    # besides those: the core's first statistics, and the acknowledgement (answered before the
    # first step)
    assert len(messages) <= len(with_tokens) + 2, [len(m.outputs) for m in messages]
    # the statistics still arrive: the last message counts every generated token
    assert messages[-1].stats["generation_tokens"] - messages[0].stats["generation_tokens"] >= 23
    assert len([s for m in messages for s in m.steps]) >= len(with_tokens)
