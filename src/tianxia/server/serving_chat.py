"""``/v1/chat/completions``: messages through the chat template, tool calls, chat logprobs."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tianxia.outputs import RequestOutput
from tianxia.server.errors import bad_request
from tianxia.server.protocol import ChatCompletionRequest
from tianxia.server.event_stream import SSE_DONE
from tianxia.server.serving_base import (
    LOGPROB_FLOOR,
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
from tianxia.server.tool_parsers import coalesce_tool_deltas, merge_tool_calls
from tianxia.structured import StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
    async def prepare(self, req: ChatCompletionRequest) -> Prepared:
        tools = self.tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls)
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
        common = self.common_fields(req)
        text, ids = await self.render_chat(
            req.messages,
            add_generation_prompt=bool(req.add_generation_prompt),
            continue_final_message=bool(req.continue_final_message),
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            # with tool_choice "none" the model is not shown tools it may not call
            tools=req.tools if tools is not None and tools.mode != "none" else None,
            add_special_tokens=bool(req.add_special_tokens),
        )
        self.check_prompt_len(len(ids), "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        fields = dict(common)
        fields["max_tokens"] = self.max_tokens(requested, len(ids), param, "messages")
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
        return Prepared(
            [(text, ids)],
            [self.build_params(fields)],
            common["n"],
            num_logprobs,
            False,
            bool(opts and opts.include_usage),
            bool(opts and opts.continuous_usage_stats),
            tools=tools,
            error_param="tools" if schema is not None else "prompt",
            echo_text=self._echo_text(req),
            cache_salt=req.cache_salt,
        )

    def _echo_text(self, req: ChatCompletionRequest) -> str:
        """vLLM's chat ``echo``: the reply starts with the last message's content when that message
        has the reply's role (an assistant message continued, or any role without a generation
        prompt)."""
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt else last.role
        if not req.echo or last.role != role:
            return ""
        content = self._messages([last])[0]["content"]
        return content if isinstance(content, str) else ""

    # --- logprobs and messages ----------------------------------------------------------------

    def logprobs(
        self, token_ids: list[int], positions: list[Any] | None, k: int
    ) -> list[dict[str, Any]]:
        """The ``logprobs.content`` entries of a chat choice for these tokens."""
        content = []
        positions = positions or []
        for j, tid in enumerate(token_ids):
            position = positions[j] if j < len(positions) else None
            lp, entry = self.sampled(position, tid)
            tok = self.token_str(tid, entry)
            top = []
            for t, tlp, e in self.entries(position)[:k]:
                s = self.token_str(t, e)
                top.append(
                    {"token": s, "logprob": clamp_logprob(tlp), "bytes": list(s.encode("utf-8"))}
                )
            content.append(
                {
                    "token": tok,
                    "logprob": clamp_logprob(lp) if lp is not None else LOGPROB_FLOOR,
                    "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": top,
                }
            )
        return content

    @staticmethod
    def _keep_calls(prep: Prepared, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """With ``parallel_tool_calls=false`` only the first call is kept."""
        if prep.tools is None or prep.tools.parallel:
            return deltas
        return [d for d in deltas if d["index"] == 0]

    def message(self, prep: Prepared, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of a full response, and whether it calls tools."""
        parser = self.tool_parser(prep)
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

    # --- the endpoint -------------------------------------------------------------------------

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        prep = await self.prepare(req)
        prep.lora_request = self.models.lora_request(model)
        rid = random_id("chatcmpl")
        created = int(time.time())
        stream = None
        if req.stream:
            head = ChunkHeader(rid, "chat.completion.chunk", created, model, prep.include_usage)
            stream = functools.partial(self._stream, head, prep)
        outs = await self.generate(rid, prep, raw, stream)
        if isinstance(outs, Response):
            return outs
        out = outs[0]
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if prep.num_logprobs is not None:
                logprobs = {
                    "content": self.logprobs(
                        c.token_ids, getattr(c, "logprobs", None), prep.num_logprobs
                    )
                }
            message, called = self.message(prep, c.text)
            if prep.echo_text:
                message["content"] = prep.echo_text + (message["content"] or "")
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
            "usage": self.usage(outs),
            "system_fingerprint": None,
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out)
        return JSONResponse(body)

    async def _stream(
        self,
        head: ChunkHeader,
        prep: Prepared,
        outputs: OutputBatches,
    ) -> AsyncIterator[bytes]:
        states: dict[int, ChoiceStream] = {}
        final: RequestOutput | None = None
        tail = b""  # the request's last events, sent with [DONE] in one write

        try:
            def every_choice(delta: dict[str, Any]) -> list[dict[str, Any]]:
                return [
                    {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                    for i in range(prep.n)
                ]

            # the assistant's role comes first, before any token is generated
            yield head.chunk(every_choice({"role": "assistant", "content": ""}))
            if prep.echo_text:
                yield head.chunk(every_choice({"content": prep.echo_text}))
            async for batch in outputs:
                for _, out in batch:
                    final = out
                    choices = []
                    for c in sorted(out.outputs, key=lambda c: c.index):
                        st = states.get(c.index)
                        if st is None:
                            st = states[c.index] = ChoiceStream(tools=self.tool_parser(prep))
                        if st.finished:
                            continue
                        delta, t0, t1 = st.advance(c)
                        finished = st.finished
                        message: dict[str, Any] = {"content": delta} if delta else {}
                        if st.tools is not None:
                            parsed = st.tools.feed(delta)
                            if finished:
                                parsed.extend(st.tools.finish())
                            calls = self._keep_calls(prep, parsed.tool_calls)
                            st.called = st.called or bool(calls)
                            message = {"content": parsed.content} if parsed.content else {}
                            if calls:
                                message["tool_calls"] = coalesce_tool_deltas(calls)
                        logprobs = None
                        if prep.num_logprobs is not None and t1 > t0:
                            logprobs = {
                                "content": self.logprobs(
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
                        usage = self.usage([out]) if prep.continuous_usage else None
                        chunk = head.chunk(choices, usage)
                        if out.finished:
                            tail = chunk
                        else:
                            yield chunk
            if prep.include_usage:
                tail += head.chunk([], self.usage([final]))
        except STREAM_ERRORS as e:
            tail += sse(engine_error(e).body())
        finally:
            await outputs.aclose()
        yield tail + SSE_DONE
