"""The OpenAI endpoints: requests to ``SamplingParams``, engine outputs to OpenAI's JSON and SSE.

Streams are built from the engine's cumulative outputs: each choice remembers how much text and
how many tokens it has sent, and emits what is new. While a choice with stop strings is running,
the last ``len(longest stop) - 1`` characters are held back, since they could still turn out to be
the start of a stop string that the engine then cuts off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from tianxia.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
    RequestUnsatisfiableError,
)
from tianxia.outputs import RequestOutput
from tianxia.structured import StructuredOutputsParams
from tianxia.sampling_params import SamplingParams
from tianxia.server.errors import APIError, bad_request, from_value_error
from tianxia.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tianxia.server.tool_parsers import (
    PARSER_NAMES,
    ToolChoice,
    ToolError,
    ToolParser,
    detect_parser,
    make_parser,
    merge_tool_calls,
    normalize_tool_messages,
    parse_tool_choice,
)

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20
MAX_N = 128
_LOGPROB_FLOOR = -9999.0

# Values that leave sampling unchanged: sent by many clients as defaults, so they are accepted even
# where the engine does not implement the parameter.
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "top_k": 0,
    "min_tokens": 0,
    "ignore_eos": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "logit_bias": {},
    "stop_token_ids": [],
    "bad_words": [],
    "top_p": 1.0,
}


def _is_neutral(name: str, value: Any) -> bool:
    if name == "top_k" and value == -1:
        return True
    return name in _NEUTRAL and value == _NEUTRAL[name]


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from any of the field families clients use."""
    found: list[tuple[str, StructuredOutputsParams]] = []

    def add(param: str, **kwargs: Any) -> None:
        try:
            found.append((param, StructuredOutputsParams(**kwargs)))
        except (TypeError, ValueError) as e:
            raise bad_request(str(e), param=param) from None

    if req.structured_outputs:
        add("structured_outputs", **req.structured_outputs)
    if req.guided_json is not None:
        add("guided_json", json=req.guided_json)
    if req.guided_regex is not None:
        add("guided_regex", regex=req.guided_regex)
    if req.guided_choice is not None:
        add("guided_choice", choice=req.guided_choice)
    if req.guided_grammar is not None:
        add("guided_grammar", grammar=req.guided_grammar)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        add("response_format", json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required", param="response_format")
        add("response_format", json=fmt.json_schema.schema_)
    if len(found) > 1:
        raise bad_request(
            "only one structured output constraint may be given; got "
            + ", ".join(p for p, _ in found),
            param=found[1][0],
        )
    return found[0][1] if found else None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _clamp(lp: float | None) -> float | None:
    if lp is None:
        return None
    lp = float(lp)
    if math.isnan(lp):
        return _LOGPROB_FLOOR
    return max(lp, _LOGPROB_FLOOR)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _ClientGone(Exception):
    pass


def _engine_error(e: BaseException) -> APIError:
    """An error that ended a request after it was accepted."""
    if isinstance(e, RequestTimeoutError):
        return APIError(504, str(e), code="request_timeout")
    if isinstance(e, RequestAbortedError):
        return APIError(503, str(e), code="server_shutting_down")
    if isinstance(e, RequestUnsatisfiableError):
        return APIError(400, str(e), code="unsatisfiable_constraints")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="request_failed")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    return APIError(500, str(e))


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class _Choice:
    """What one choice has streamed so far."""

    hold: int  # characters held back while running (longest stop string - 1)
    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0
    finished: bool = False
    started: bool = False
    tools: ToolParser | None = None  # parses this choice's text into tool calls
    called: bool = False  # a tool-call delta was sent


@dataclass
class _Prepared:
    """A validated request, ready for the engine: one (text, ids, params) per prompt."""

    prompts: list[tuple[str | None, list[int]]]
    params: list[SamplingParams]
    n: int
    num_logprobs: int | None
    echo: bool
    include_usage: bool
    continuous_usage: bool
    tools: ToolChoice | None = None
    error_param: str = "prompt"  # the field named by an error raised when the request is added


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: list[str],
        *,
        chat_template: str | None = None,
        metrics: Any = None,
        retry_after_s: int = 1,
        tool_call_parser: str | None = "auto",
    ) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        self.model_names = served_model_names
        self.model_name = served_model_names[0]
        self.max_model_len = self.llm.max_model_len
        self.vocab_size = self.llm.model_config.vocab_size
        self.chat_template = chat_template or self.llm.chat_template
        if tool_call_parser == "auto":
            tool_call_parser = detect_parser(self.chat_template)
        elif tool_call_parser is not None and tool_call_parser not in PARSER_NAMES:
            raise ValueError(
                f"unknown tool-call parser {tool_call_parser!r}; choose auto or one of "
                + ", ".join(PARSER_NAMES)
            )
        self.tool_call_parser = tool_call_parser
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.draining = False
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}
        self._supported = {f.name for f in dataclasses.fields(SamplingParams) if f.init}

    # --- shared checks ------------------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return self.model_name
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down; retry on another instance.",
                code="server_shutting_down",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if not self.engine.is_running:
            raise APIError(503, "The engine is not running.", code="engine_dead")

    def token_str(self, token_id: int, entry: Any = None) -> str:
        decoded = getattr(entry, "decoded_token", None)
        if isinstance(decoded, str):
            return decoded
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_strs) < 200_000:
                self._token_strs[token_id] = s
        return s

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of client text; text that is not valid Unicode (a lone surrogate escaped in
        the JSON, which the tokenizer cannot take) is a 400."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, UnicodeError):
            raise bad_request(f"{param} is not valid Unicode text", param=param) from None

    def _check_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(
                    f"{param} contains token id {t}, outside [0, {self.vocab_size})", param=param
                )

    def _check_prompt_len(self, n: int, what: str) -> None:
        if n == 0:
            raise bad_request(f"the {what} is empty", param=what)
        if n >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your {what} resulted in {n} tokens (at least one token must be left to generate). "
                f"Please reduce the length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str, what: str) -> int:
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested < 1:
            raise bad_request(f"{param} must be at least 1, got {requested}", param=param)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the {what}, "
                f"{requested} in the completion). Please reduce the length of the {what} or completion.",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    # --- sampling parameters ------------------------------------------------------------------

    def _common_fields(self, req: Any) -> dict[str, Any]:
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", param="n")
        logit_bias = None
        if req.logit_bias:
            logit_bias = {}
            for k, v in req.logit_bias.items():
                try:
                    tid = int(k)
                except ValueError:
                    raise bad_request(
                        f"logit_bias keys must be token ids, got {k!r}", param="logit_bias"
                    ) from None
                if not 0 <= tid < self.vocab_size:
                    raise bad_request(
                        f"logit_bias has token id {tid}, outside [0, {self.vocab_size})",
                        param="logit_bias",
                    )
                if not -100.0 <= v <= 100.0:
                    raise bad_request(
                        f"logit_bias values must be in [-100, 100], got {v}", param="logit_bias"
                    )
                logit_bias[tid] = float(v)
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(req, name)
            if ids:
                self._check_ids(ids, name)
        if req.allowed_token_ids is not None and not req.allowed_token_ids:
            raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}", param="prompt_logprobs"
            )
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options can only be set when stream is true", param="stream_options"
            )
        return {
            "n": n,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": req.stop,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "logit_bias": logit_bias,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty,
            "min_tokens": req.min_tokens,
            "ignore_eos": req.ignore_eos,
            "stop_token_ids": req.stop_token_ids,
            "skip_special_tokens": req.skip_special_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "prompt_logprobs": req.prompt_logprobs,
            "bad_words": req.bad_words,
            "allowed_token_ids": req.allowed_token_ids,
            "structured_outputs": structured_outputs(req),
        }

    def build_params(self, fields: dict[str, Any]) -> SamplingParams:
        kwargs: dict[str, Any] = {}
        for name, value in fields.items():
            if value is None:
                continue
            if name not in self._supported:
                if _is_neutral(name, value):
                    continue
                raise bad_request(
                    f"`{name}` is not supported by this server yet",
                    param=name,
                    code="unsupported_parameter",
                )
            kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise from_value_error(e) from None

    # --- adding and collecting ----------------------------------------------------------------

    async def _add_all(self, rid: str, prep: _Prepared) -> list[tuple[str, asyncio.Queue]]:
        self.check_accepting()
        added: list[tuple[str, asyncio.Queue]] = []
        try:
            for i, ((text, ids), params) in enumerate(zip(prep.prompts, prep.params)):
                sub = rid if len(prep.prompts) == 1 else f"{rid}-{i}"
                prompt = {"prompt_token_ids": ids}
                if text is not None:
                    prompt["prompt"] = text
                q = await self.engine.add_request(sub, prompt, params)
                added.append((sub, q))
        except BaseException as e:
            for sub, _ in added:
                self.engine.abort(sub)
            if isinstance(e, QueueFullError):
                if self.metrics is not None:
                    self.metrics.rejected.inc()
                raise APIError(
                    503, str(e), code="queue_full", headers={"Retry-After": str(self.retry_after_s)}
                ) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), code="engine_dead") from None
            if isinstance(e, (ValueError, TypeError)):
                raise from_value_error(e, prep.error_param) from None
            raise
        return added

    async def _collect(
        self, queues: list[tuple[str, asyncio.Queue]], raw: Request
    ) -> list[RequestOutput]:
        async def one(rid: str, q: asyncio.Queue) -> RequestOutput:
            last = None
            async for out in self.engine.iterate(rid, q):
                last = out
            return last

        tasks = [asyncio.ensure_future(one(rid, q)) for rid, q in queues]
        gathered = asyncio.gather(*tasks)
        disconnect = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait(
                {gathered, disconnect}, return_when=asyncio.FIRST_COMPLETED
            )
            if gathered in done:
                return gathered.result()
            raise _ClientGone()
        except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
            raise _engine_error(e) from None
        finally:
            disconnect.cancel()
            for t in tasks:
                t.cancel()
            if not gathered.done():
                gathered.cancel()

    def _pumps(
        self, queues: list[tuple[str, asyncio.Queue]]
    ) -> tuple[asyncio.Queue, list[asyncio.Task]]:
        """Start one task per engine request, all feeding one queue of ``(prompt_index, item)``."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rid: str, q: asyncio.Queue) -> None:
            try:
                async for out in self.engine.iterate(rid, q):
                    merged.put_nowait((i, out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the stream
                merged.put_nowait((i, e))
            else:
                merged.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, rid, q)) for i, (rid, q) in enumerate(queues)]
        return merged, tasks

    @staticmethod
    def _cancel(tasks: list[asyncio.Task]) -> None:
        for t in tasks:
            if not t.done():
                t.cancel()

    async def _merged_outputs(
        self, merged: asyncio.Queue, count: int
    ) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Batches of the newest output of each prompt, until every prompt finished."""
        remaining = count
        while remaining:
            items = [await merged.get()]
            while not merged.empty():
                items.append(merged.get_nowait())
            latest: dict[int, RequestOutput] = {}
            for i, item in items:
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    latest[i] = item
            if latest:
                yield sorted(latest.items())

    def _usage(self, outs: list[RequestOutput | None]) -> dict[str, Any]:
        prompt = sum(len(o.prompt_token_ids) for o in outs if o is not None)
        completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
        cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs if o is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # --- logprobs -----------------------------------------------------------------------------

    @staticmethod
    def _entries(position: Any) -> list[tuple[int, float, Any]]:
        """``{token_id: Logprob | float}`` to ``[(token_id, logprob, entry)]``, best first."""
        if not position:
            return []
        rows = []
        for tid, v in position.items():
            lp = getattr(v, "logprob", v)
            rank = getattr(v, "rank", None)
            rows.append((int(tid), float(lp), v, rank))
        rows.sort(key=lambda r: (r[3] if isinstance(r[3], int) and r[3] > 0 else math.inf, -r[1]))
        return [(t, lp, v) for t, lp, v, _ in rows]

    def _sampled(self, position: Any, token_id: int) -> tuple[float | None, Any]:
        if not position:
            return None, None
        v = position.get(token_id)
        if v is None:
            return None, None
        return float(getattr(v, "logprob", v)), v

    def completion_logprobs(
        self, token_ids: list[int], positions: list[Any] | None, k: int, offset: int
    ) -> tuple[dict[str, Any], int]:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        positions = positions or []
        for j, tid in enumerate(token_ids):
            position = positions[j] if j < len(positions) else None
            lp, entry = self._sampled(position, tid)
            tok = self.token_str(tid, entry)
            tokens.append(tok)
            text_offset.append(offset)
            offset += len(tok)
            if position is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_clamp(lp))
            top: dict[str, float] = {}
            for t, tlp, e in self._entries(position)[:k]:
                top.setdefault(self.token_str(t, e), _clamp(tlp))
            # as OpenAI: the sampled token is always there (so up to logprobs + 1 entries)
            top.setdefault(tok, _clamp(lp))
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }, offset

    def chat_logprobs(
        self, token_ids: list[int], positions: list[Any] | None, k: int
    ) -> list[dict[str, Any]]:
        content = []
        positions = positions or []
        for j, tid in enumerate(token_ids):
            position = positions[j] if j < len(positions) else None
            lp, entry = self._sampled(position, tid)
            tok = self.token_str(tid, entry)
            top = []
            for t, tlp, e in self._entries(position)[:k]:
                s = self.token_str(t, e)
                top.append({"token": s, "logprob": _clamp(tlp), "bytes": list(s.encode("utf-8"))})
            content.append(
                {
                    "token": tok,
                    "logprob": _clamp(lp) if lp is not None else _LOGPROB_FLOOR,
                    "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": top,
                }
            )
        return content

    # --- stream bookkeeping -------------------------------------------------------------------

    @staticmethod
    def _hold(params: SamplingParams) -> int:
        stops = getattr(params, "stop_strings", None) or []
        return max((len(s) for s in stops), default=1) - 1

    @staticmethod
    def _advance(st: _Choice, text: str, num_tokens: int, finished: bool) -> tuple[str, int, int]:
        """Text not yet sent (minus the held-back tail) and the range of tokens not yet sent."""
        end = len(text) if finished or st.hold == 0 else max(st.text_sent, len(text) - st.hold)
        delta = text[st.text_sent : end]
        t0 = st.tokens_sent
        st.text_sent = max(st.text_sent, end)
        st.tokens_sent = num_tokens
        st.finished = finished
        return delta, t0, num_tokens

    # --- /v1/completions ----------------------------------------------------------------------

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            raw: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [list(p)]
        else:
            raw = list(p)
        if not raw:
            raise bad_request("prompt must not be empty", param="prompt")
        out = []
        for item in raw:
            if isinstance(item, str):
                ids = self.encode(item, bool(req.add_special_tokens), "prompt")
                text: str | None = item
            else:
                ids = list(item)
                self._check_ids(ids, "prompt")
                text = None
            self._check_prompt_len(len(ids), "prompt")
            out.append((text, ids))
        return out

    def prepare_completion(self, req: CompletionRequest) -> _Prepared:
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
        common = self._common_fields(req)
        prompts = self._completion_prompts(req)
        echo = bool(req.echo)
        params = []
        for _, ids in prompts:
            fields = dict(common)
            fields["max_tokens"] = self._max_tokens(
                req.max_tokens, len(ids), "max_tokens", "prompt"
            )
            fields["logprobs"] = req.logprobs
            if echo and req.logprobs is not None and fields.get("prompt_logprobs") is None:
                fields["prompt_logprobs"] = req.logprobs
            params.append(self.build_params(fields))
        opts = req.stream_options
        return _Prepared(
            prompts,
            params,
            n,
            req.logprobs,
            echo,
            bool(opts and opts.include_usage),
            bool(opts and opts.continuous_usage_stats),
        )

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    def _echo_logprobs(self, out: RequestOutput, k: int) -> tuple[dict[str, Any], int]:
        return self.completion_logprobs(
            out.prompt_token_ids, getattr(out, "prompt_logprobs", None), k, 0
        )

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        prep = self.prepare_completion(req)
        rid = random_id("cmpl")
        created = int(time.time())
        queues = await self._add_all(rid, prep)
        if req.stream:
            merged, tasks = self._pumps(queues)
            return StreamingResponse(
                self._completion_stream(rid, created, model, prep, merged, tasks),
                media_type="text/event-stream",
                background=BackgroundTask(self._cancel, tasks),
            )
        try:
            outs = await self._collect(queues, raw)
        except _ClientGone:
            return Response(status_code=499)
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
                    lp, _ = self.completion_logprobs(
                        c.token_ids, getattr(c, "logprobs", None), prep.num_logprobs, offset
                    )
                    if logprobs is None:
                        logprobs = lp
                    else:
                        for key in logprobs:
                            logprobs[key] = logprobs[key] + lp[key]
                choice = {
                    "index": i * prep.n + c.index,
                    "text": prompt_text + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs_json(out)
                choices.append(choice)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": self._usage(outs),
            "system_fingerprint": None,
        }
        return JSONResponse(body)

    def _prompt_logprobs_json(self, out: RequestOutput) -> list[Any] | None:
        plp = getattr(out, "prompt_logprobs", None)
        if plp is None:
            return None
        result = []
        for position in plp:
            if not position:
                result.append(None)
                continue
            result.append(
                {
                    str(t): {
                        "logprob": _clamp(lp),
                        "rank": getattr(e, "rank", None),
                        "decoded_token": self.token_str(t, e),
                    }
                    for t, lp, e in self._entries(position)
                }
            )
        return result

    async def _completion_stream(
        self,
        rid: str,
        created: int,
        model: str,
        prep: _Prepared,
        merged: asyncio.Queue,
        tasks: list[asyncio.Task],
    ) -> AsyncIterator[str]:
        n = prep.n
        states: dict[int, _Choice] = {}
        finals: dict[int, RequestOutput] = {}

        def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> str:
            body = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if prep.include_usage:
                body["usage"] = usage
            return _sse(body)

        try:
            async for batch in self._merged_outputs(merged, len(tasks)):
                for i, out in batch:
                    finals[i] = out
                    choices = []
                    for c in sorted(out.outputs, key=lambda c: c.index):
                        idx = i * n + c.index
                        st = states.get(idx)
                        if st is None:
                            st = states[idx] = _Choice(self._hold(prep.params[i]))
                        if st.finished:
                            continue
                        finished = c.finish_reason is not None
                        delta, t0, t1 = self._advance(st, c.text, len(c.token_ids), finished)
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
                            lp, st.text_offset = self.completion_logprobs(
                                c.token_ids[t0:t1],
                                (getattr(c, "logprobs", None) or [])[t0:t1],
                                prep.num_logprobs,
                                st.text_offset,
                            )
                            if logprobs is None:
                                logprobs = lp
                            else:
                                for key in logprobs:
                                    logprobs[key] = logprobs[key] + lp[key]
                        text = prefix + delta
                        if not text and not finished and logprobs is None:
                            continue
                        st.started = True
                        choices.append(
                            {
                                "index": idx,
                                "text": text,
                                "logprobs": logprobs,
                                "finish_reason": c.finish_reason if finished else None,
                                "stop_reason": c.stop_reason if finished else None,
                            }
                        )
                    if choices:
                        usage = (
                            self._usage(list(finals.values())) if prep.continuous_usage else None
                        )
                        yield chunk(choices, usage)
            if prep.include_usage:
                body = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(list(finals.values())),
                }
                yield _sse(body)
        except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
            yield _sse(_engine_error(e).body())
        finally:
            self._cancel(tasks)
        yield "data: [DONE]\n\n"

    # --- /v1/chat/completions -----------------------------------------------------------------

    def _messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(messages):
            d = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    kind = part.get("type")
                    if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                        parts.append(part["text"])
                    else:
                        raise bad_request(
                            f"messages[{i}].content: only text parts are supported, got {kind!r}",
                            param=f"messages[{i}].content",
                        )
                d["content"] = "".join(parts) if len(parts) != 1 else parts[0]
            elif content is None:
                d["content"] = ""
            out.append(d)
        try:
            normalize_tool_messages(out)
        except ToolError as e:
            raise bad_request(str(e), param=e.param) from None
        return out

    def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        chat_template_kwargs: dict[str, Any] | None,
        tools: Any,
        add_special_tokens: bool,
    ) -> tuple[str, list[int]]:
        template = chat_template or self.chat_template
        if template is None:
            raise bad_request(
                "this model has no chat template; start the server with --chat-template",
                param="messages",
            )
        if add_generation_prompt and continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            text = self.tokenizer.apply_chat_template(
                self._messages(messages),
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors, raise_exception() in templates, bad roles
            raise bad_request(f"cannot apply the chat template: {e}", param="messages") from None
        return text, self.encode(text, add_special_tokens, "messages")

    def _tool_choice(self, req: ChatCompletionRequest) -> ToolChoice | None:
        try:
            choice = parse_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ToolError as e:
            raise bad_request(str(e), param=e.param) from None
        if choice is not None and choice.mode == "auto" and self.tool_call_parser is None:
            raise bad_request(
                "tool_choice 'auto' needs a tool-call parser, and this model's chat template has no "
                "known tool-call format; start the server with --tool-call-parser, or use "
                "tool_choice 'required' or a named function",
                param="tool_choice",
            )
        return choice

    def prepare_chat(self, req: ChatCompletionRequest) -> _Prepared:
        tools = self._tool_choice(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request(
                    "logprobs must be true when top_logprobs is set", param="top_logprobs"
                )
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                    param="top_logprobs",
                )
        common = self._common_fields(req)
        text, ids = self.render_chat(
            req.messages,
            add_generation_prompt=bool(req.add_generation_prompt),
            continue_final_message=bool(req.continue_final_message),
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            # with tool_choice "none" the model is not shown tools it may not call
            tools=req.tools if tools is not None and tools.mode != "none" else None,
            add_special_tokens=bool(req.add_special_tokens),
        )
        self._check_prompt_len(len(ids), "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        fields = dict(common)
        fields["max_tokens"] = self._max_tokens(requested, len(ids), param, "messages")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        fields["logprobs"] = num_logprobs
        schema = tools.schema() if tools is not None else None
        if schema is not None:
            if fields["structured_outputs"] is not None:
                raise bad_request(
                    "a structured output constraint cannot be combined with tool_choice "
                    "'required' or a named function",
                    param="tool_choice",
                )
            # the call is decoded under its JSON schema, so it is always valid
            fields["structured_outputs"] = StructuredOutputsParams(json=schema)
        opts = req.stream_options
        return _Prepared(
            [(text, ids)],
            [self.build_params(fields)],
            common["n"],
            num_logprobs,
            False,
            bool(opts and opts.include_usage),
            bool(opts and opts.continuous_usage_stats),
            tools=tools,
            error_param="tools" if schema is not None else "prompt",
        )

    def _tool_parser(self, prep: _Prepared) -> ToolParser | None:
        return make_parser(prep.tools, self.tool_call_parser) if prep.tools is not None else None

    @staticmethod
    def _keep_calls(prep: _Prepared, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """With ``parallel_tool_calls=false`` only the first call is kept."""
        if prep.tools is None or prep.tools.parallel:
            return deltas
        return [d for d in deltas if d["index"] == 0]

    def _chat_message(self, prep: _Prepared, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of a full response, and whether it calls tools."""
        parser = self._tool_parser(prep)
        if parser is None:
            return {"role": "assistant", "content": text}, False
        parsed = parser.feed(text)
        parsed.extend(parser.finish())
        calls = merge_tool_calls(self._keep_calls(prep, parsed.tool_calls))
        if prep.tools is not None and prep.tools.mode == "auto":
            # as vLLM: a call the model wrote with broken JSON is no call; the text is returned
            try:
                for call in calls:
                    json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                calls = []
        if not calls:
            return {"role": "assistant", "content": text}, False
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, True

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        prep = self.prepare_chat(req)
        rid = random_id("chatcmpl")
        created = int(time.time())
        queues = await self._add_all(rid, prep)
        if req.stream:
            merged, tasks = self._pumps(queues)
            return StreamingResponse(
                self._chat_stream(rid, created, model, prep, merged, tasks),
                media_type="text/event-stream",
                background=BackgroundTask(self._cancel, tasks),
            )
        try:
            outs = await self._collect(queues, raw)
        except _ClientGone:
            return Response(status_code=499)
        out = outs[0]
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if prep.num_logprobs is not None:
                logprobs = {
                    "content": self.chat_logprobs(
                        c.token_ids, getattr(c, "logprobs", None), prep.num_logprobs
                    )
                }
            message, called = self._chat_message(prep, c.text)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": "tool_calls"
                    if called and c.finish_reason == "stop"
                    else c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": self._usage(outs),
            "system_fingerprint": None,
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json(out)
        return JSONResponse(body)

    async def _chat_stream(
        self,
        rid: str,
        created: int,
        model: str,
        prep: _Prepared,
        merged: asyncio.Queue,
        tasks: list[asyncio.Task],
    ) -> AsyncIterator[str]:
        states: dict[int, _Choice] = {}
        final: RequestOutput | None = None

        def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> str:
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if prep.include_usage:
                body["usage"] = usage
            return _sse(body)

        try:
            # the assistant's role comes first, before any token is generated
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(prep.n)
                ]
            )
            async for batch in self._merged_outputs(merged, len(tasks)):
                for _, out in batch:
                    final = out
                    choices = []
                    for c in sorted(out.outputs, key=lambda c: c.index):
                        st = states.get(c.index)
                        if st is None:
                            st = states[c.index] = _Choice(self._hold(prep.params[0]))
                            st.tools = self._tool_parser(prep)
                        if st.finished:
                            continue
                        finished = c.finish_reason is not None
                        delta, t0, t1 = self._advance(st, c.text, len(c.token_ids), finished)
                        message: dict[str, Any] = {"content": delta} if delta else {}
                        if st.tools is not None:
                            parsed = st.tools.feed(delta)
                            if finished:
                                parsed.extend(st.tools.finish())
                            calls = self._keep_calls(prep, parsed.tool_calls)
                            st.called = st.called or bool(calls)
                            message = {"content": parsed.content} if parsed.content else {}
                            if calls:
                                message["tool_calls"] = calls
                        logprobs = None
                        if prep.num_logprobs is not None and t1 > t0:
                            logprobs = {
                                "content": self.chat_logprobs(
                                    c.token_ids[t0:t1],
                                    (getattr(c, "logprobs", None) or [])[t0:t1],
                                    prep.num_logprobs,
                                )
                            }
                        if not message and not finished and logprobs is None:
                            continue
                        finish_reason = c.finish_reason if finished else None
                        if st.called and finish_reason == "stop":
                            finish_reason = "tool_calls"
                        choices.append(
                            {
                                "index": c.index,
                                "delta": message,
                                "logprobs": logprobs,
                                "finish_reason": finish_reason,
                                "stop_reason": c.stop_reason if finished else None,
                            }
                        )
                    if choices:
                        usage = self._usage([out]) if prep.continuous_usage else None
                        yield chunk(choices, usage)
            if prep.include_usage:
                body = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage([final]),
                }
                yield _sse(body)
        except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
            yield _sse(_engine_error(e).body())
        finally:
            self._cancel(tasks)
        yield "data: [DONE]\n\n"
