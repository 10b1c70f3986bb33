"""SGLang's native routes, so that SGLang's own frontend (``sgl.RuntimeEndpoint``) and scripts
written for an SGLang server run against ``tianxia serve`` unchanged.

- ``POST /generate``: ``{"text" | "input_ids", "sampling_params", "return_logprob",
  "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream"}``; answers
  ``{"text", "output_ids", "meta_info"}`` (a list for a batch of prompts), or server-sent events
  whose ``text`` is cumulative and whose ``output_token_logprobs`` are the chunk's new ones, ending
  in ``data: [DONE]``. ``max_new_tokens: 0`` computes the prompt only (what the frontend sends to
  fill the prefix cache and to score ``select`` choices).
- ``GET /get_model_info``, ``GET /get_server_info`` and ``/server_info``, ``POST /flush_cache``,
  ``POST /concate_and_append_request`` (the frontend's fork join; nothing to do here).

Logprob entries are SGLang's ``[logprob, token_id, text or None]``; the first prompt token has no
logprob (``None``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tianxia import __version__
from tianxia.outputs import CompletionOutput, RequestOutput
from tianxia.server.errors import bad_request
from tianxia.server.protocol import INT64_MAX, INT64_MIN, Int, _Base
from tianxia.server.event_stream import SSE_DONE
from tianxia.server.serving_base import (
    MAX_LOGPROBS,
    STREAM_ERRORS,
    OpenAIServing,
    OutputBatches,
    Prepared,
    clamp_logprob,
    engine_error,
    random_id,
    sse,
)
from tianxia.structured import StructuredOutputsParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's


class GenerateRequest(_Base):
    text: str | list[str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: Int | None = None
    top_logprobs_num: Int | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = None
    model: str | None = None  # picks the model on a server with several (not SGLang's)


class ConcatenateRequest(_Base):
    src_rids: list[str]
    dst_rid: str


# SGLang's sampling parameter -> SamplingParams' (those with the same meaning)
_SAMPLING = {
    "min_new_tokens": "min_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "n": "n",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
}


class SGLangServing(OpenAIServing):
    async def _prompts(self, req: GenerateRequest) -> tuple[list[tuple[str | None, list[int]]], bool]:
        """(text, ids) per prompt, and whether the request is a batch."""
        if (req.text is None) == (req.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", param="text")
        if req.text is not None:
            batch = isinstance(req.text, list)
            texts = req.text if batch else [req.text]
            prompts = [(t, await self.encode(t, True, "text")) for t in texts]
        else:
            ids = req.input_ids
            batch = bool(ids) and isinstance(ids[0], list)
            prompts = [(None, list(x)) for x in (ids if batch else [ids])]
            for _, x in prompts:
                self.check_ids(x, "input_ids")
        if not prompts:
            raise bad_request("the batch of prompts is empty", param="text")
        for _, ids in prompts:
            self.check_prompt_len(len(ids), "text" if req.text is not None else "input_ids")
        return prompts, batch

    async def prepare(self, req: GenerateRequest) -> tuple[Prepared, bool, bool]:
        """The engine requests, whether it is a batch, and whether it only fills the prompt."""
        prompts, batch = await self._prompts(req)
        sp = req.sampling_params
        for key, value in sp.items():
            # the fields of the dict are not typed by the request model: bound them here
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                raise bad_request(f"sampling_params.{key} is out of range",
                                  param=f"sampling_params.{key}")
        # SGLang's frontend sends every field, unset ones as null or empty
        unknown = {k for k, v in sp.items() if v not in (None, [], "")} - {
            *_SAMPLING, "max_new_tokens", "regex", "json_schema", "no_stop_trim"}
        if unknown:
            raise bad_request(f"sampling_params.{sorted(unknown)[0]} is not supported",
                              param=f"sampling_params.{sorted(unknown)[0]}")
        fields = {ours: sp[theirs] for theirs, ours in _SAMPLING.items()
                  if sp.get(theirs) is not None}
        if fields.get("top_k") == -1:
            fields["top_k"] = 0
        constraint = {k: sp[k] for k in ("regex", "json_schema") if sp.get(k) is not None}
        if len(constraint) > 1:
            raise bad_request("give one of regex and json_schema", param="sampling_params")
        if constraint:
            kind, value = next(iter(constraint.items()))
            fields["structured_outputs"] = StructuredOutputsParams(
                **({"regex": value} if kind == "regex" else {"json": value}))
        k = req.top_logprobs_num or 0
        if not 0 <= k <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be between 0 and {MAX_LOGPROBS}",
                              param="top_logprobs_num")
        start = None
        if req.return_logprob:
            fields["logprobs"] = k
            fields["prompt_logprobs"] = k
            start = max(0, req.logprob_start_len or 0)
        requested = sp.get("max_new_tokens")
        if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool)
                                      or requested < 0):
            raise bad_request("sampling_params.max_new_tokens must be an integer >= 0",
                              param="sampling_params.max_new_tokens")
        prefill_only = requested == 0
        params = []
        for _, ids in prompts:
            f = dict(fields)
            if requested is None:
                f["max_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, self.max_model_len - len(ids))
            else:
                # a prompt-only request still samples one token (the engine's unit of work),
                # which the answer leaves out
                f["max_tokens"] = self.max_tokens(max(1, requested), len(ids),
                                                  "sampling_params.max_new_tokens", "prompt")
            if prefill_only:
                f.pop("logprobs", None)
            params.append(self.build_params(f))
        prep = Prepared(prompts, params, fields.get("n", 1), None, False, False, False,
                        prompt_logprobs_start=start)
        return prep, batch, prefill_only

    # --- SGLang's output shape ----------------------------------------------------------------

    def _lp(self, token: int, entry: Any, with_text: bool) -> list[Any]:
        lp = getattr(entry, "logprob", entry)
        return [None if lp is None else clamp_logprob(lp), token,
                self.token_str(token, entry) if with_text else None]

    def _top(self, position: Any, k: int, with_text: bool) -> list[list[Any]] | None:
        if not position:
            return None
        return [self._lp(t, e, with_text) for t, _, e in self.entries(position)[:k]]

    def _meta(self, req: GenerateRequest, rid: str, out: RequestOutput, c: CompletionOutput,
              prefill_only: bool, sent_logprobs: int, t0: float) -> dict[str, Any]:
        tokens = [] if prefill_only else c.token_ids
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": None,
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(tokens),
            "cached_tokens": out.num_cached_tokens,
            "e2e_latency": time.monotonic() - t0,
        }
        if c.finish_reason is not None:
            if prefill_only or c.finish_reason == "length":
                meta["finish_reason"] = {"type": "length", "length": len(tokens)}
            else:
                meta["finish_reason"] = {"type": c.finish_reason, "matched": c.stop_reason}
        if req.return_logprob:
            text = req.return_text_in_logprobs
            k = req.top_logprobs_num or 0
            start = max(0, req.logprob_start_len or 0)
            plp = out.prompt_logprobs or []
            ids = out.prompt_token_ids
            meta["input_token_logprobs"] = [
                self._lp(t, (plp[i] or {}).get(t) if i < len(plp) and plp[i] else None, text)
                for i, t in enumerate(ids) if i >= start
            ]
            positions = [] if prefill_only else (c.logprobs or [])
            new = range(sent_logprobs, len(tokens))
            meta["output_token_logprobs"] = [
                self._lp(tokens[i], positions[i].get(tokens[i]) if i < len(positions) else None,
                         text) for i in new]
            meta["output_token_logprobs_length"] = len(tokens)
            if k:
                meta["input_top_logprobs"] = [
                    self._top(plp[i] if i < len(plp) else None, k, text)
                    for i in range(start, len(ids))]
                meta["output_top_logprobs"] = [
                    self._top(positions[i] if i < len(positions) else None, k, text) for i in new]
        return meta

    def _result(self, req, rid, out, c, prefill_only, sent, t0, text: str) -> dict[str, Any]:
        return {"text": text, "output_ids": [] if prefill_only else list(c.token_ids),
                "meta_info": self._meta(req, rid, out, c, prefill_only, sent, t0)}

    # --- the routes ---------------------------------------------------------------------------

    async def generate_native(self, req: GenerateRequest, raw: Request) -> Response:
        prep, batch, prefill_only = await self.prepare(req)
        if req.stream and (batch or prep.n != 1):
            raise bad_request("stream takes one prompt and n = 1", param="stream")
        rid = req.rid or random_id("gen")
        t0 = time.monotonic()
        if req.stream:
            return await self.generate(
                rid, prep, raw, lambda outputs: self._stream(req, rid, prep, prefill_only,
                                                             outputs, t0))
        outs = await self.generate(rid, prep, raw, None)
        if isinstance(outs, Response):
            return outs
        results = [
            self._result(req, out.request_id, out, c, prefill_only, 0, t0,
                         "" if prefill_only else c.text)
            for out in outs for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        return JSONResponse(results if batch or prep.n > 1 else results[0])

    async def _stream(self, req, rid, prep: Prepared, prefill_only: bool,
                      outputs: OutputBatches, t0: float) -> AsyncIterator[bytes]:
        sent_text = sent_tokens = 0
        tail = b""  # the request's last event, sent with [DONE] in one write
        try:
            async for batch in outputs:
                for _, out in batch:
                    c = out.outputs[0]
                    stable = len(c.text) if c.stable_len is None else c.stable_len
                    end = len(c.text) if c.finish_reason is not None else max(sent_text, stable)
                    if end == sent_text and c.finish_reason is None:
                        continue
                    text = "" if prefill_only else c.text[:end]
                    chunk = sse(self._result(req, rid, out, c, prefill_only, sent_tokens, t0, text))
                    if out.finished:
                        tail = chunk
                    else:
                        yield chunk
                    sent_text, sent_tokens = end, len(c.token_ids)
        except STREAM_ERRORS as e:
            tail += sse(engine_error(e).body())
        finally:
            await outputs.aclose()
        yield tail + SSE_DONE

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.models.name,
            "tokenizer_path": self.models.name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.llm.model_config, "architecture", None),
        }

    def server_info(self) -> dict[str, Any]:
        cache = self.llm.config.cache
        return {
            "version": __version__,
            "model_path": self.models.name,
            "served_model_name": self.models.name,
            "context_length": self.max_model_len,
            "max_total_num_tokens": self.llm.num_usable_blocks * cache.block_size,
            "page_size": cache.block_size,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "internal_states": [dict(self.engine.stats())],
        }

    async def flush_cache(self) -> Response:
        if await self.engine.utility("reset_prefix_cache"):
            return Response("Cache flushed.\n", media_type="text/plain")
        return Response("Cache not flushed: requests are running; retry when idle.\n",
                        status_code=400, media_type="text/plain")

