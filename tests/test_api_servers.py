"""``tianxia serve --api-server-count 2``: two API processes on one port, one engine core or two
(``--data-parallel-size 2``).

Real processes and the ``openai`` client: concurrent requests get the offline engine's greedy
text, both API processes answer (each names its pid in a response header), ``/metrics`` from
either counts every request (and, with two cores, each core's tokens), and the process tree goes
away as a whole: a SIGKILLed API process takes the server down with status 1, a SIGKILLed
supervisor leaves no process and no bound port.
"""

from __future__ import annotations

import re
import signal
import socket
import threading

import httpx
import openai
import pytest

from tianxia import SamplingParams
from tianxia.server.testing import ServerProcess, metric

from test_engine_core import (ARGS, MODEL, PROMPTS, alive, core_pids, greedy_texts, sigkill_server,
                              wait_until)

API_ARGS = [*ARGS, "--api-server-count", "2"]


def api_pids(srv: ServerProcess) -> list[int]:
    return [int(p) for p in re.findall(r"API server \d+: process (\d+)", srv.log())]


@pytest.fixture(scope="module")
def offline_texts(smollm2_llm):
    outs = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    return [o.outputs[0].text for o in outs]


def concurrent_greedy_texts(url: str, batches: int = 3) -> list[list[str]]:
    """``greedy_texts`` sent ``batches`` times at once, from as many threads."""
    results: list[list[str]] = [[] for _ in range(batches)]

    def batch(k: int) -> None:
        results[k] = greedy_texts(url)

    threads = [threading.Thread(target=batch, args=(k,)) for k in range(batches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def answering_pids(url: str, tries: int = 40) -> set[int]:
    """The API processes that answered requests on fresh connections (until both did)."""
    seen: set[int] = set()
    for _ in range(tries):
        with openai.OpenAI(base_url=url + "/v1", api_key="none") as client:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
        seen.add(int(raw.headers["x-tianxia-api-server-pid"]))
        if len(seen) == 2:
            break
    return seen


def test_two_api_servers_share_the_port_and_the_core(offline_texts):
    srv = ServerProcess(API_ARGS).start()
    try:
        apis, cores = api_pids(srv), core_pids(srv)
        assert len(apis) == 2 and len(cores) == 1
        assert all(alive(p) for p in (*apis, *cores))
        assert srv.proc.pid not in apis

        # concurrent requests through both processes
        assert all(texts == offline_texts for texts in concurrent_greedy_texts(srv.url))

        # a stop string found by an API process ends the request there (and in the core)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                         temperature=0).choices[0].text
        cut = full.split()[1]
        stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                            temperature=0, stop=[cut]).choices[0]
        assert stopped.finish_reason == "stop" and stopped.text == full[: full.index(cut)]

        assert answering_pids(srv.url) == set(apis)

        # either process's /metrics counts the requests both served (the core sends its
        # statistics to every API process)
        def served() -> list[float]:
            return [metric(httpx.get(srv.url + "/metrics").text, "vllm:request_success_total",
                           model_name=MODEL, finished_reason=r) or 0 for r in ("length", "stop")]

        wait_until(lambda: sum(served()) >= 3 * len(PROMPTS) + 2 + 2, 10, "requests counted")
        assert served()[1] >= 1  # the stop-string request, counted as "stop"

        # an API process that dies takes the whole server down, non-zero
        srv_pids = [*apis, *cores]
        import os

        os.kill(apis[0], signal.SIGKILL)
        assert srv.wait(15) == 1
        wait_until(lambda: not any(alive(p) for p in srv_pids), 10, "every process gone")
    finally:
        srv.stop()


def test_sigkilled_supervisor_takes_every_process_along():
    srv = ServerProcess(API_ARGS).start()
    try:
        pids = [*api_pids(srv), *core_pids(srv)]
        assert len(pids) == 3
        sigkill_server(srv, pids, 10)
        with socket.socket() as s:  # nothing keeps the port
            s.bind((srv.host, srv.port))
    finally:
        srv.stop()


def test_two_api_servers_in_front_of_two_data_parallel_cores(offline_texts):
    srv = ServerProcess([*API_ARGS, "--data-parallel-size", "2", "--threads", "1"]).start()
    try:
        apis, cores = api_pids(srv), core_pids(srv)
        assert len(apis) == 2 and len(cores) == 2
        assert all(alive(p) for p in (*apis, *cores))

        # concurrent requests through both processes, to both cores
        assert all(texts == offline_texts for texts in concurrent_greedy_texts(srv.url))
        assert answering_pids(srv.url) == set(apis)

        # each core's own series reach every API process (the cores send their statistics to
        # all of them), so one scrape shows that both cores generated
        def tokens_per_core() -> list[float]:
            text = httpx.get(srv.url + "/metrics").text
            return [metric(text, "tianxia:engine_generation_tokens_total", model_name=MODEL,
                           engine=str(i)) or 0 for i in (0, 1)]

        wait_until(lambda: all(n > 0 for n in tokens_per_core()), 10, "both cores generated")

        sigkill_server(srv, [*apis, *cores], 10)
        # nothing listens on the port (the connections the dead processes held linger in
        # TIME_WAIT, which a server's SO_REUSEADDR bind ignores)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((srv.host, srv.port))
            s.listen()
    finally:
        srv.stop()


def test_api_server_count_flags_are_one_line_errors():
    import subprocess
    import sys

    for flags, message in [
        (["--api-server-count", "0"], "--api-server-count must be at least 1"),
        (["--api-server-count", "2", "--engine-core", "thread"],
         "--api-server-count needs --engine-core process"),
        (["--api-server-count", "2", "--enable-lora", "--allow-runtime-lora-updating"],
         "--allow-runtime-lora-updating does not combine with --api-server-count"),
    ]:
        r = subprocess.run([sys.executable, "-m", "tianxia.cli", "serve", MODEL, *flags],
                           capture_output=True, text=True, timeout=120, check=False)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr


def test_default_api_server_count():
    from tianxia.server.api_servers import default_api_server_count

    # a CPU's cores compute the steps; a GPU gets one API process per core, at least 2, while
    # there are 4 CPUs for each
    assert default_api_server_count("cpu", 64) == 1
    assert default_api_server_count("cuda", 16) == 2
    assert default_api_server_count("cuda", 7) == 1
    assert default_api_server_count("cuda", 16, data_parallel_size=4) == 4
    assert default_api_server_count("cuda", 12, data_parallel_size=4) == 1
