"""``/v1/completions``: prompts (text, token ids, or lists of either), ``echo``, ``logprobs``."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tianxia.outputs import RequestOutput
from tianxia.server.errors import bad_request
from tianxia.server.protocol import CompletionRequest
from tianxia.server.event_stream import SSE_DONE
from tianxia.server.serving_base import (
    MAX_LOGPROBS,
    STREAM_ERRORS,
    ChoiceStream,
    ChunkHeader,
    OpenAIServing,
    OutputBatches,
    Prepared,
    clamp_logprob,
    engine_error,
    random_id,
    sse,
)


class OpenAIServingCompletion(OpenAIServing):
    async def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        raw = self.prompt_items(req.prompt)
        if not raw:
            raise bad_request("prompt must not be empty", param="prompt")
        out = []
        for item in raw:
            if isinstance(item, str):
                ids = await self.encode(item, bool(req.add_special_tokens), "prompt")
                text: str | None = item
            else:
                ids = list(item)
                self.check_ids(ids, "prompt")
                text = None
            self.check_prompt_len(len(ids), "prompt")
            out.append((text, ids))
        return out

    async def prepare(self, req: CompletionRequest) -> Prepared:
        if req.suffix:
            raise bad_request(
                "suffix is not supported", param="suffix", code="unsupported_parameter"
            )
        n = 1 if req.n is None else req.n
        if req.best_of is not None and req.best_of != n:
            raise bad_request(
                "best_of must be equal to n (best_of > n is not supported)",
                param="best_of",
                code="unsupported_parameter",
            )
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}",
                param="logprobs",
            )
        common = self.common_fields(req)
        prompts = await self._prompts(req)
        echo = bool(req.echo)
        params = []
        for _, ids in prompts:
            fields = dict(common)
            fields["max_tokens"] = self.max_tokens(req.max_tokens, len(ids), "max_tokens", "prompt")
            fields["logprobs"] = req.logprobs
            if echo and req.logprobs is not None and fields.get("prompt_logprobs") is None:
                fields["prompt_logprobs"] = req.logprobs
            params.append(self.build_params(fields))
        opts = req.stream_options
        return Prepared(
            prompts,
            params,
            n,
            req.logprobs,
            echo,
            bool(opts and opts.include_usage),
            bool(opts and opts.continuous_usage_stats),
            cache_salt=req.cache_salt,
        )

    # --- logprobs -----------------------------------------------------------------------------

    def logprobs(
        self, token_ids: list[int], positions: list[Any] | None, k: int, offset: int
    ) -> tuple[dict[str, Any], int]:
        """OpenAI's completion ``logprobs`` object for these tokens, and the text offset after."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        positions = positions or []
        for j, tid in enumerate(token_ids):
            position = positions[j] if j < len(positions) else None
            lp, entry = self.sampled(position, tid)
            tok = self.token_str(tid, entry)
            tokens.append(tok)
            text_offset.append(offset)
            offset += len(tok)
            if position is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(clamp_logprob(lp))
            top: dict[str, float] = {}
            for t, tlp, e in self.entries(position)[:k]:
                top.setdefault(self.token_str(t, e), clamp_logprob(tlp))
            # as OpenAI: the sampled token is always there (so up to logprobs + 1 entries)
            top.setdefault(tok, clamp_logprob(lp))
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }, offset

    def _echo_logprobs(self, out: RequestOutput, k: int) -> tuple[dict[str, Any], int]:
        return self.logprobs(out.prompt_token_ids, getattr(out, "prompt_logprobs", None), k, 0)

    @staticmethod
    def _join_logprobs(first: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
        if first is None:
            return more
        return {key: first[key] + more[key] for key in first}

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    # --- the endpoint -------------------------------------------------------------------------

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        prep = await self.prepare(req)
        prep.lora_request = self.models.lora_request(model)
        rid = random_id("cmpl")
        created = int(time.time())
        stream = None
        if req.stream:
            head = ChunkHeader(rid, "text_completion", created, model, prep.include_usage)
            stream = functools.partial(self._stream, head, prep)
        outs = await self.generate(rid, prep, raw, stream)
        if isinstance(outs, Response):
            return outs
        choices = []
        for i, out in enumerate(outs):
            text0, ids = prep.prompts[i]
            prompt_text = self._prompt_text(text0, ids) if prep.echo else ""
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = None
                if prep.num_logprobs is not None:
                    offset = 0
                    if prep.echo:
                        logprobs, offset = self._echo_logprobs(out, prep.num_logprobs)
                    lp, _ = self.logprobs(
                        c.token_ids, getattr(c, "logprobs", None), prep.num_logprobs, offset
                    )
                    logprobs = self._join_logprobs(logprobs, lp)
                choice = {
                    "index": i * prep.n + c.index,
                    "text": prompt_text + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs_json(out)
                choices.append(choice)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": self.usage(outs),
            "system_fingerprint": None,
        }
        return JSONResponse(body)

    async def _stream(
        self,
        head: ChunkHeader,
        prep: Prepared,
        outputs: OutputBatches,
    ) -> AsyncIterator[bytes]:
        n = prep.n
        states: dict[int, ChoiceStream] = {}
        finals: dict[int, RequestOutput] = {}
        tail = b""  # the request's last events, sent with [DONE] in one write

        try:
            async for batch in outputs:
                for i, out in batch:
                    finals[i] = out
                    choices = []
                    for c in sorted(out.outputs, key=lambda c: c.index):
                        idx = i * n + c.index
                        st = states.setdefault(idx, ChoiceStream())
                        if st.finished:
                            continue
                        delta, t0, t1 = st.advance(c)
                        logprobs = None
                        prefix = ""
                        if not st.started and prep.echo:
                            text0, ids = prep.prompts[i]
                            prefix = self._prompt_text(text0, ids)
                            if prep.num_logprobs is not None:
                                logprobs, st.text_offset = self._echo_logprobs(
                                    out, prep.num_logprobs
                                )
                        if prep.num_logprobs is not None and (t1 > t0 or logprobs is not None):
                            lp, st.text_offset = self.logprobs(
                                c.token_ids[t0:t1],
                                (getattr(c, "logprobs", None) or [])[t0:t1],
                                prep.num_logprobs,
                                st.text_offset,
                            )
                            logprobs = self._join_logprobs(logprobs, lp)
                        text = prefix + delta
                        if not text and not st.finished and logprobs is None:
                            continue
                        st.started = True
                        choices.append(
                            {
                                "index": idx,
                                "text": text,
                                "logprobs": logprobs,
                                "finish_reason": c.finish_reason if st.finished else None,
                                "stop_reason": c.stop_reason if st.finished else None,
                            }
                        )
                    if choices:
                        usage = self.usage(list(finals.values())) if prep.continuous_usage else None
                        chunk = head.chunk(choices, usage)
                        if len(finals) == len(prep.prompts) and all(o.finished for o in finals.values()):
                            tail = chunk
                        else:
                            yield chunk
            if prep.include_usage:
                tail += head.chunk([], self.usage(list(finals.values())))
        except STREAM_ERRORS as e:
            tail += sse(engine_error(e).body())
        finally:
            await outputs.aclose()
        yield tail + SSE_DONE
