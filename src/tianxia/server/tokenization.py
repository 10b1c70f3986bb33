"""Client text to token ids off the event loop, in batches.

A server that receives many requests at once (a load balancer's burst, a benchmark at an infinite
rate) would otherwise encode their prompts one after another on its event loop, a fraction of a
millisecond each for a few hundred tokens, while it also streams every running request's tokens.
:class:`BatchedEncoder` gathers the texts of requests that arrive together and encodes them with
one call on a worker thread: a fast tokenizer's batch encode releases the GIL and spreads the batch
over the machine's cores (as vLLM's micro-batching tokenizer does). While one batch is encoded,
the next one gathers.

At ``--log-level debug`` each batch logs when its texts were queued, sent to the worker and handed
back, on the host's monotonic clock (``benchmarks/burst_admission.py`` lines them up with the
engine's steps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from transformers import PreTrainedTokenizerBase

# texts per batch call: large enough to spread over many cores, small enough that a burst's first
# prompts reach the engine before its last ones are encoded
MAX_BATCH = 128

logger = logging.getLogger(__name__)


class BatchedEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._pending: list[tuple[str, bool, asyncio.Future, float]] = []
        self._busy = False
        self._executor: ThreadPoolExecutor | None = None

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)``; raises what it raises (TypeError or
        UnicodeError for text the tokenizer cannot take) for this text alone."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((text, add_special_tokens, fut, time.monotonic()))
        if not self._busy:
            self._busy = True
            # after the handlers already scheduled in this turn of the loop: their texts join
            loop.call_soon(self._submit, loop)
        return await fut

    def _submit(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
        batch = [item for item in batch if not item[2].done()]  # a disconnected client's
        if not batch:
            self._done(loop)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tianxia-tokenize")
        work = loop.run_in_executor(self._executor, _encode_batch, self.tokenizer,
                                    [(text, special) for text, special, *_ in batch])
        work.add_done_callback(partial(self._deliver, loop, batch, time.monotonic()))

    def _deliver(self, loop: asyncio.AbstractEventLoop, batch, submitted: float,
                 work: asyncio.Future) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("encoded %d texts: queued at %.4f-%.4f, submitted at %.4f, delivered at %.4f",
                         len(batch), batch[0][3], batch[-1][3], submitted, time.monotonic())
        if work.cancelled():  # the executor was shut down (close) before the batch ran
            results: list = [None] * len(batch)
        else:
            error = work.exception()
            results = [error] * len(batch) if error is not None else work.result()
        for (_, _, fut, _), result in zip(batch, results):
            if fut.done():
                continue
            if result is None:
                fut.cancel()
            elif isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
        self._done(loop)

    def _done(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._pending:
            loop.call_soon(self._submit, loop)
        else:
            self._busy = False

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _encode_batch(
    tokenizer: PreTrainedTokenizerBase, items: list[tuple[str, bool]]
) -> list[list[int] | BaseException]:
    """Each text's ids, one batch call per ``add_special_tokens`` value; a batch that fails (one
    text the tokenizer cannot take) is encoded text by text, so that only that text fails."""
    out: list[list[int] | BaseException] = [[] for _ in items]
    for special in {s for _, s in items}:
        index = [i for i, (_, s) in enumerate(items) if s == special]
        texts = [items[i][0] for i in index]
        try:
            ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
        except Exception:  # noqa: BLE001 - find the text(s) at fault below
            ids = []
            for text in texts:
                try:
                    ids.append(tokenizer.encode(text, add_special_tokens=special))
                except Exception as e:  # noqa: BLE001 - handed to that request
                    ids.append(e)
        for i, r in zip(index, ids):
            out[i] = r
    return out
