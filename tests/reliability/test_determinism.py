"""Seeded sampling is reproducible: the same seeded request gives the same text alone, inside a
batch of other requests, and on another server process (a restart) with a different batch size
limit (16 sequence slots vs 2).

This holds with exact products (``--cpu-activations float32``). With the default 8-bit
activations a request's logits depend slightly on how its step was computed (a few rows through
the direct kernel, many through BLAS), so a sampled token can change with the batch, as in
llama.cpp; the two servers here therefore run with float32 activations."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from reliability_helpers import GUARDED_ARGS, MODEL, SMALL_ARGS, auth_client, serve

EXACT = ["--cpu-activations", "float32"]


@pytest.fixture(scope="module")
def exact16(smollm2_path):
    yield from serve([MODEL, *GUARDED_ARGS, *EXACT])


@pytest.fixture(scope="module")
def exact2(smollm2_path):
    yield from serve([MODEL, *SMALL_ARGS, *EXACT])

SEEDED = [
    {"prompt": "Once upon a time", "seed": 1234, "temperature": 0.9, "max_tokens": 24},
    {"prompt": "The best way to cook rice is", "seed": 7, "temperature": 1.0, "top_p": 0.9,
     "max_tokens": 24, "n": 2},
]
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "seed": 99,
        "temperature": 0.8, "max_tokens": 24}


def texts(http: httpx.Client) -> list[list[str]]:
    out = []
    for body in SEEDED:
        r = http.post("/v1/completions", json={"model": MODEL, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        out.append([c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])])
    r = http.post("/v1/chat/completions", json={"model": MODEL, **CHAT})
    assert r.status_code == 200, r.text
    out.append([r.json()["choices"][0]["message"]["content"]])
    return out


def noise(http: httpx.Client, i: int) -> int:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"Noise {i}: " * (i + 1),
                                           "max_tokens": 30, "temperature": 1.0,
                                           "ignore_eos": True})
    return r.status_code


def test_seeded_outputs_alone_batched_and_after_restart(exact16, exact2):
    with auth_client(exact16.url) as http:
        alone = texts(http)
        assert all(t for choice in alone for t in choice)
        assert alone[1][0] != alone[1][1]  # the n choices draw different seeds
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            others = [pool.submit(noise, http, i) for i in range(7)]
            batched = texts(http)
            assert [f.result() for f in others] == [200] * 7
        assert batched == alone
    with auth_client(exact2.url) as http:  # another process, 2 sequence slots
        assert texts(http) == alone
