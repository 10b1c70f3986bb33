"""Prompts encoded off the event loop in batches (``server/tokenization.py``): a burst of
concurrent requests gets, text by text, what the tokenizer's own ``encode`` gives, and a text the
tokenizer cannot take fails its own request only."""

from __future__ import annotations

import asyncio

import pytest

from tianxia.server.tokenization import MAX_BATCH, BatchedEncoder


def test_a_burst_is_encoded_as_the_tokenizer_encodes_each_text(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    texts = [f"Request {i}: the capital of France is Paris, 東京 🤖 {'x' * (i % 7)}"
             for i in range(2 * MAX_BATCH + 5)]
    encoder = BatchedEncoder(tok)

    async def burst():
        return await asyncio.gather(*(encoder.encode(t, i % 2 == 0) for i, t in enumerate(texts)))

    got = asyncio.run(burst())
    assert got == [tok.encode(t, add_special_tokens=i % 2 == 0) for i, t in enumerate(texts)]
    encoder.close()


def test_each_batch_logs_when_its_texts_were_queued_sent_and_returned(smollm2_llm, caplog):
    """At debug level every batch says when it was queued, sent to the worker and handed back, on
    the monotonic clock (what ``benchmarks/burst_admission.py`` lines up with the engine's steps)."""
    import logging
    import re
    import time

    encoder = BatchedEncoder(smollm2_llm.get_tokenizer())
    texts = [f"text {i}" for i in range(MAX_BATCH + 3)]

    async def burst():
        return await asyncio.gather(*(encoder.encode(t, False) for t in texts))

    start = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="tianxia.server.tokenization"):
        asyncio.run(burst())
    end = time.monotonic()
    encoder.close()
    batches = [re.fullmatch(r"encoded (\d+) texts: queued at ([\d.]+)-([\d.]+), submitted at ([\d.]+), "
                            r"delivered at ([\d.]+)", r.getMessage()) for r in caplog.records]
    assert batches and all(batches)
    assert sum(int(m[1]) for m in batches) == len(texts) and max(int(m[1]) for m in batches) == MAX_BATCH
    for m in batches:
        queued0, queued1, submitted, delivered = (float(m[i]) for i in range(2, 6))
        assert start - 1e-3 <= queued0 <= queued1 <= submitted + 1e-3 <= delivered + 1e-3 <= end + 2e-3


def test_a_text_the_tokenizer_cannot_take_fails_alone(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    encoder = BatchedEncoder(tok)
    bad = "a lone surrogate \ud800 here"
    with pytest.raises((TypeError, UnicodeError)):
        tok.encode(bad)

    async def burst():
        return await asyncio.gather(encoder.encode("good one", False), encoder.encode(bad, False),
                                    encoder.encode("good two", False), return_exceptions=True)

    first, failed, last = asyncio.run(burst())
    assert first == tok.encode("good one", add_special_tokens=False)
    assert last == tok.encode("good two", add_special_tokens=False)
    assert isinstance(failed, (TypeError, UnicodeError))
    encoder.close()



def test_closing_cancels_the_waiting_requests(smollm2_llm):
    """A batch that never ran (the encoder closed while it waited for the worker thread) cancels
    its requests instead of leaving them waiting forever."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    encoder = BatchedEncoder(smollm2_llm.get_tokenizer())
    encoder._executor = ThreadPoolExecutor(1)
    release = threading.Event()
    encoder._executor.submit(release.wait)  # the worker is busy: the batch queues behind it

    async def closed_under_a_burst():
        waiting = [asyncio.ensure_future(encoder.encode(f"text {i}", False)) for i in range(3)]
        for _ in range(3):  # the encodes run, then the batch is handed to the executor
            await asyncio.sleep(0)
        encoder.close()
        release.set()
        return await asyncio.gather(*waiting, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(closed_under_a_burst(), 30))
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
