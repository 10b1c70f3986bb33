"""What every endpoint family shares: request checks, sampling parameters, chat rendering, adding
requests to the engine and collecting or streaming their outputs.

Each family (``serving_completions``, ``serving_chat``, ``serving_tokenize``, ...) subclasses
:class:`OpenAIServing`, as vLLM's endpoint classes do.

Streams are built from the engine's cumulative outputs: each choice remembers how much text and
how many tokens it has sent, and sends what is new up to the output's ``stable_len`` (the
detokenizer's account of the text that can no longer change: while a choice with stop strings
runs, its last ``len(longest stop) - 1`` characters could still begin a stop string that the
engine then cuts off).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from tianxia.engine.async_engine import (
    EngineClient,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
    RequestUnsatisfiableError,
)
from tianxia.engine.lora_manager import LoRARequest
from tianxia.outputs import CompletionOutput, RequestOutput
from tianxia.sampling_params import SamplingParams
from tianxia.server.errors import APIError, bad_request, from_value_error
from tianxia.server.event_stream import EventStreamResponse
from tianxia.server.protocol import ChatMessage
from tianxia.server.serving_models import ServingModels
from tianxia.server.tokenization import BatchedEncoder
from tianxia.server.tool_parsers import (
    PARSER_NAMES,
    ToolChoice,
    ToolError,
    ToolParser,
    detect_parser,
    make_parser,
    normalize_tool_messages,
    parse_tool_choice,
)
from tianxia.structured import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128
LOGPROB_FLOOR = -9999.0

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
            raise bad_request(
                "response_format.json_schema.schema is required", param="response_format"
            )
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


def clamp_logprob(lp: float | None) -> float | None:
    """A logprob JSON can carry: NaN and -inf become a floor."""
    if lp is None:
        return None
    lp = float(lp)
    if math.isnan(lp):
        return LOGPROB_FLOOR
    return max(lp, LOGPROB_FLOOR)


_json = msgspec.json.Encoder()


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event of ``obj`` as compact UTF-8 JSON (msgspec: a stream sends one per
    step and this is several times cheaper than ``json.dumps``)."""
    return b"data: " + _json.encode(obj) + b"\n\n"




@dataclass(frozen=True)
class ChunkHeader:
    """The fields every chunk of one stream repeats."""

    id: str
    object: str
    created: int
    model: str
    include_usage: bool

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return sse(body)


class ClientGone(Exception):
    """The client closed the connection before its (non-streamed) response was ready."""


STREAM_ERRORS = (EngineStepError, EngineDeadError, RequestAbortedError)


def engine_error(e: BaseException) -> APIError:
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


class OutputBatches:
    """The outputs of a request's engine requests (one per prompt), as batches of the newest
    output of each prompt, until every prompt finished; iterate once. One prompt (nearly every
    request) streams straight from its engine queue; several are merged by one task each.
    :meth:`aclose` ends whatever still runs (the engine aborts it and frees its KV blocks)."""

    def __init__(self, engine: EngineClient, queues: list[tuple[str, asyncio.Queue]]) -> None:
        self._engine = engine
        self._queues = queues
        self._tasks: list[asyncio.Task] = []
        self._started = False
        if len(queues) == 1:
            self._batches = self._one()
        else:
            self._merged: asyncio.Queue = asyncio.Queue()
            self._tasks = [asyncio.ensure_future(self._pump(i, rid, q))
                           for i, (rid, q) in enumerate(queues)]
            self._batches = self._several()

    def __aiter__(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        self._started = True
        return self._batches

    async def aclose(self) -> None:
        for t in self._tasks:
            if not t.done():
                t.cancel()
        if not self._started and len(self._queues) == 1:
            self._engine.abort(self._queues[0][0])  # its iterator never ran, so cannot abort it
        await self._batches.aclose()

    async def _one(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        rid, q = self._queues[0]
        async for out in self._engine.iterate(rid, q):  # leaving early aborts the request
            yield [(0, out)]

    async def _pump(self, i: int, rid: str, q: asyncio.Queue) -> None:
        try:
            async for out in self._engine.iterate(rid, q):
                self._merged.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the stream
            self._merged.put_nowait((i, e))
        else:
            self._merged.put_nowait((i, None))

    async def _several(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        merged, remaining = self._merged, len(self._tasks)
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


@dataclass
class ChoiceStream:
    """What one choice has streamed so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0
    finished: bool = False
    started: bool = False
    tools: ToolParser | None = None  # parses this choice's text into tool calls
    called: bool = False  # a tool-call delta was sent

    def advance(self, c: CompletionOutput) -> tuple[str, int, int]:
        """The text not yet sent that can no longer change, and the range of new tokens."""
        stable = len(c.text) if c.stable_len is None else c.stable_len
        end = max(self.text_sent, stable)
        delta = c.text[self.text_sent : end]
        t0 = self.tokens_sent
        self.text_sent = end
        self.tokens_sent = len(c.token_ids)
        self.finished = c.finish_reason is not None
        return delta, t0, self.tokens_sent


@dataclass
class Prepared:
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
    echo_text: str = ""  # chat ``echo``: the last message's content, sent before the reply
    prompt_logprobs_start: int | None = None  # prompt logprobs only from this position on
    cache_salt: str | None = None  # the request's prefix-cache salt (vLLM's ``cache_salt``)
    lora_request: LoRARequest | None = None  # the adapter the request's ``model`` names


@dataclass
class ServerState:
    """What the endpoints share with the process around them."""

    metrics: Any = None
    retry_after_s: int = 1
    draining: bool = False  # set on SIGTERM: new requests get a 503
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter


class OpenAIServing:
    """The engine, tokenizer and chat template behind one model, and the checks, conversions and
    request plumbing every endpoint family uses."""

    def __init__(
        self,
        engine: EngineClient,
        models: ServingModels,
        state: ServerState,
        *,
        chat_template: str | None = None,
        tool_call_parser: str | None = "auto",
        encoder: BatchedEncoder | None = None,
    ) -> None:
        self.engine = engine
        self.llm = engine.info
        self.models = models
        self.state = state
        self.tokenizer = self.llm.tokenizer
        # shared by a model's endpoint families, so that their requests' texts batch together
        self.encoder = encoder or BatchedEncoder(self.tokenizer)
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
        self._token_strs: dict[int, str] = {}
        self._supported = {f.name for f in dataclasses.fields(SamplingParams) if f.init}

    # --- shared checks ------------------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        return self.models.resolve(name)

    def check_accepting(self) -> None:
        if self.state.draining:
            raise APIError(
                503,
                "The server is shutting down; retry on another instance.",
                code="server_shutting_down",
                headers={"Retry-After": str(self.state.retry_after_s)},
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

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of client text (encoded off the event loop, batched with other requests');
        text that is not valid Unicode (a lone surrogate escaped in the JSON, which the tokenizer
        cannot take) is a 400."""
        try:
            return await self.encoder.encode(text, add_special_tokens)
        except (TypeError, UnicodeError):
            raise bad_request(f"{param} is not valid Unicode text", param=param) from None

    @staticmethod
    def prompt_items(p: Any) -> list[Any]:
        """The items of a prompt field: a string, a list of strings, token ids, or lists of them."""
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def check_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(
                    f"{param} contains token id {t}, outside [0, {self.vocab_size})", param=param
                )

    def check_prompt_len(self, n: int, what: str) -> None:
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

    def max_tokens(self, requested: int | None, prompt_len: int, param: str, what: str) -> int:
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

    def common_fields(self, req: Any) -> dict[str, Any]:
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
                self.check_ids(ids, name)
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

    # --- chat rendering -----------------------------------------------------------------------

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

    async def render_chat(
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
        return text, await self.encode(text, add_special_tokens, "messages")

    def tool_choice(
        self, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None
    ) -> ToolChoice | None:
        try:
            choice = parse_tool_choice(tools, tool_choice, parallel_tool_calls)
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

    def tool_parser(self, prep: Prepared) -> ToolParser | None:
        return make_parser(prep.tools, self.tool_call_parser) if prep.tools is not None else None

    # --- adding and collecting ----------------------------------------------------------------

    async def add_all(self, rid: str, prep: Prepared) -> list[tuple[str, asyncio.Queue]]:
        self.check_accepting()
        added: list[tuple[str, asyncio.Queue]] = []
        try:
            for i, ((text, ids), params) in enumerate(zip(prep.prompts, prep.params)):
                sub = rid if len(prep.prompts) == 1 else f"{rid}-{i}"
                prompt = {"prompt_token_ids": ids}
                if text is not None:
                    prompt["prompt"] = text
                if prep.prompt_logprobs_start:
                    prompt["prompt_logprobs_start"] = prep.prompt_logprobs_start
                if prep.cache_salt is not None:
                    prompt["cache_salt"] = prep.cache_salt
                q = await self.engine.add_request(sub, prompt, params, prep.lora_request)
                added.append((sub, q))
        except BaseException as e:
            for sub, _ in added:
                self.engine.abort(sub)
            if isinstance(e, QueueFullError):
                if self.state.metrics is not None:
                    self.state.metrics.rejected.inc()
                raise APIError(
                    503,
                    str(e),
                    code="queue_full",
                    headers={"Retry-After": str(self.state.retry_after_s)},
                ) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), code="engine_dead") from None
            if isinstance(e, (ValueError, TypeError)):
                raise from_value_error(e, prep.error_param) from None
            raise
        return added

    async def generate(
        self,
        rid: str,
        prep: Prepared,
        raw: Request,
        stream: Callable[[OutputBatches], AsyncIterator[bytes | str]] | None,
    ) -> Response | list[RequestOutput]:
        """Add the request to the engine; with ``stream``, the server-sent events it makes of the
        outputs, else the final outputs (or a 499 once the client is gone)."""
        queues = await self.add_all(rid, prep)
        if stream is not None:
            outputs = OutputBatches(self.engine, queues)
            return EventStreamResponse(
                stream(outputs),
                # a response that never started streaming still ends its engine requests
                background=BackgroundTask(outputs.aclose),
            )
        try:
            return await self.collect(queues, raw)
        except ClientGone:
            return Response(status_code=499)

    async def collect(
        self, queues: list[tuple[str, asyncio.Queue]], raw: Request
    ) -> list[RequestOutput]:
        """The final outputs of every request; :class:`ClientGone` (and every request aborted)
        if the client disconnects first."""

        async def one(rid: str, q: asyncio.Queue) -> RequestOutput:
            last = None
            async for out in self.engine.iterate(rid, q):
                last = out
            return last

        tasks = [asyncio.ensure_future(one(rid, q)) for rid, q in queues]
        gathered = asyncio.gather(*tasks)
        # once the client is gone the tasks are cancelled and nobody awaits the gather: take its
        # CancelledError here, or asyncio logs "exception was never retrieved" with a traceback
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        disconnect = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait(
                {gathered, disconnect}, return_when=asyncio.FIRST_COMPLETED
            )
            if gathered in done:
                return gathered.result()
            raise ClientGone()
        except STREAM_ERRORS as e:
            raise engine_error(e) from None
        finally:
            disconnect.cancel()
            for t in tasks:
                t.cancel()
            if not gathered.done():
                gathered.cancel()

    @staticmethod
    def usage(outs: list[RequestOutput | None]) -> dict[str, Any]:
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
    def entries(position: Any) -> list[tuple[int, float, Any]]:
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

    @staticmethod
    def sampled(position: Any, token_id: int) -> tuple[float | None, Any]:
        if not position:
            return None, None
        v = position.get(token_id)
        if v is None:
            return None, None
        return float(getattr(v, "logprob", v)), v

    def prompt_logprobs_json(self, out: RequestOutput) -> list[Any] | None:
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
                        "logprob": clamp_logprob(lp),
                        "rank": getattr(e, "rank", None),
                        "decoded_token": self.token_str(t, e),
                    }
                    for t, lp, e in self.entries(position)
                }
            )
        return result
