"""``/v1/responses``: OpenAI's Responses API over the chat machinery.

A request becomes chat messages (``instructions`` as the system message, then the conversation
of ``previous_response_id``, then ``input``: messages, ``function_call`` and
``function_call_output`` items), its flat ``tools`` become chat tools, ``text.format`` becomes
``response_format``; the chat code renders, constrains and parses tool calls, and the output is
reshaped into ``message`` and ``function_call`` items. A stream is the Responses event sequence
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``), each event
with its ``sequence_number``.

Responses with ``store`` (the default) are kept in memory, the most recent
``MAX_STORED_RESPONSES``, so that a later request can continue one with ``previous_response_id``
and ``GET /v1/responses/{id}`` can return it; an evicted or unknown id is a 404.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tianxia.outputs import RequestOutput
from tianxia.server.errors import APIError, bad_request, validation_error
from tianxia.server.protocol import ChatCompletionRequest, ResponsesRequest
from tianxia.server.serving_base import (
    STREAM_ERRORS,
    ChoiceStream,
    OutputBatches,
    Prepared,
    engine_error,
)
from tianxia.server.serving_chat import OpenAIServingChat
from tianxia.server.tool_parsers import coalesce_tool_deltas

MAX_STORED_RESPONSES = 1000
# chat fields named by an error, and the Responses fields the client sent
_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input",
           "response_format": "text.format", "prompt": "input"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text", "output_text", "text"
            ) or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{i}]: only text parts are supported",
                                  param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of text parts",
                      param=f"{where}.content")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses ``input`` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer",
                                  param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported", param=f"{where}.type")
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f'tools[{i}].type must be "function" (the tool types served here)',
                              param=f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    return {"type": fmt["type"]}


class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # id -> (the response, its conversation as chat messages, without the instructions)
        self.stored: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def _history(self, previous: str | None) -> list[dict[str, Any]]:
        if previous is None:
            return []
        found = self.stored.get(previous)
        if found is None:
            raise APIError(404, f"Previous response with id '{previous}' not found.",
                           param="previous_response_id", code="not_found")
        self.stored.move_to_end(previous)
        return [dict(m) for m in found[1]]

    def retrieve(self, response_id: str) -> dict[str, Any]:
        found = self.stored.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           param="response_id", code="not_found")
        return found[0]

    def _store(self, resp: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.stored[resp["id"]] = (resp, conversation)
        while len(self.stored) > MAX_STORED_RESPONSES:
            self.stored.popitem(last=False)

    async def _prepare(self, req: ResponsesRequest) -> tuple[Prepared, list[dict[str, Any]]]:
        conversation = self._history(req.previous_response_id) + input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat = {
            "messages": system + conversation,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text),
        }
        try:
            creq = ChatCompletionRequest.model_validate({k: v for k, v in chat.items()
                                                         if v is not None})
            return await self.prepare(creq), conversation
        except ValidationError as e:
            err = validation_error(list(e.errors()))
        except APIError as e:
            err = e
        if err.param is not None:
            head = err.param.split("[")[0].split(".")[0]
            if head in _PARAMS:
                err.param = _PARAMS[head] + err.param[len(head):]
        raise err

    # --- the response object ------------------------------------------------------------------

    def _response(self, req: ResponsesRequest, rid: str, created: int, model: str,
                  output: list[dict[str, Any]], status: str,
                  out: RequestOutput | None) -> dict[str, Any]:
        usage = None
        if out is not None:
            u = self.usage([out])
            usage = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            }
        reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
        incomplete = status == "completed" and reason == "length"
        return {
            "id": rid, "object": "response", "created_at": created, "model": model,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "output": output, "usage": usage,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}},
            "metadata": req.metadata or {}, "store": req.store is not False,
            "truncation": "disabled", "user": req.user,
        }

    @staticmethod
    def _message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}] if status == "completed" else []}

    @staticmethod
    def _call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                "status": status}

    def _finish(self, req: ResponsesRequest, rid: str, created: int, model: str,
                output: list[dict[str, Any]], out: RequestOutput | None,
                conversation: list[dict[str, Any]], text: str,
                calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The completed response; stored (with the conversation it ends) unless ``store`` is
        false."""
        resp = self._response(req, rid, created, model, output, "completed", out)
        if req.store is not False:
            reply: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                reply["tool_calls"] = calls
            self._store(resp, [*conversation, reply])
        return resp

    # --- the endpoint -------------------------------------------------------------------------

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        prep, conversation = await self._prepare(req)
        rid = _id("resp")
        created = int(time.time())
        if req.stream:
            return await self.generate(rid, prep, raw, lambda outputs: self._events(
                req, rid, created, model, prep, conversation, outputs))
        outs = await self.generate(rid, prep, raw, None)
        if isinstance(outs, Response):
            return outs
        out = outs[0]
        message, _ = self.message(prep, out.outputs[0].text)
        calls = message.get("tool_calls") or []
        output = []
        if message.get("content"):
            output.append(self._message_item(message["content"], _id("msg")))
        output += [self._call_item(c, _id("fc")) for c in calls]
        return JSONResponse(self._finish(req, rid, created, model, output, out, conversation,
                                         message.get("content") or "", calls))

    async def _events(self, req: ResponsesRequest, rid: str, created: int, model: str,
                      prep: Prepared, conversation: list[dict[str, Any]],
                      outputs: OutputBatches) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            body = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        output: list[dict[str, Any]] = []
        text = ""
        msg: tuple[int, str] | None = None  # (output_index, item id) of the open message
        calls: dict[int, tuple[int, dict[str, Any]]] = {}  # call index -> (output_index, call)

        def close_message() -> list[str]:
            nonlocal msg
            if msg is None:
                return []
            index, item_id = msg
            msg = None
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item = self._message_item(text, item_id)
            output[index] = item
            return [
                event("response.output_text.done", item_id=item_id, output_index=index,
                      content_index=0, text=text, logprobs=[]),
                event("response.content_part.done", item_id=item_id, output_index=index,
                      content_index=0, part=part),
                event("response.output_item.done", output_index=index, item=item),
            ]

        st = ChoiceStream(tools=self.tool_parser(prep))
        final: RequestOutput | None = None
        start = self._response(req, rid, created, model, [], "in_progress", None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        try:
            async for batch in outputs:
                for _, final in batch:
                    c = final.outputs[0]
                    if st.finished:
                        continue
                    delta, _, _ = st.advance(c)
                    content, deltas = delta, []
                    if st.tools is not None:
                        parsed = st.tools.feed(delta)
                        if st.finished:
                            parsed.extend(st.tools.finish())
                        content, deltas = parsed.content, coalesce_tool_deltas(
                            self._keep_calls(prep, parsed.tool_calls))
                    if content:
                        if msg is None:
                            msg = (len(output), _id("msg"))
                            output.append(self._message_item("", msg[1], "in_progress"))
                            yield event("response.output_item.added", output_index=msg[0],
                                        item=output[msg[0]])
                            yield event("response.content_part.added", item_id=msg[1],
                                        output_index=msg[0], content_index=0,
                                        part={"type": "output_text", "text": "",
                                              "annotations": [], "logprobs": []})
                        text += content
                        yield event("response.output_text.delta", item_id=msg[1],
                                    output_index=msg[0], content_index=0, delta=content,
                                    logprobs=[])
                    for d in deltas:
                        if d["index"] not in calls:
                            for e in close_message():
                                yield e
                            call = {"id": d["id"], "type": "function", "function": {
                                "name": d["function"]["name"], "arguments": ""}}
                            item = self._call_item(call, _id("fc"), "in_progress")
                            calls[d["index"]] = (len(output), call)
                            output.append(item)
                            yield event("response.output_item.added",
                                        output_index=len(output) - 1, item=item)
                        index, call = calls[d["index"]]
                        piece = d["function"].get("arguments", "")
                        if piece:
                            call["function"]["arguments"] += piece
                            yield event("response.function_call_arguments.delta",
                                        item_id=output[index]["id"], output_index=index,
                                        delta=piece)
            for e in close_message():
                yield e
            for index, call in calls.values():
                item = self._call_item(call, output[index]["id"])
                output[index] = item
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
            resp = self._finish(req, rid, created, model, output, final, conversation, text,
                                [call for _, call in calls.values()])
            yield event("response.incomplete" if resp["status"] == "incomplete"
                        else "response.completed", response=resp)
        except STREAM_ERRORS as e:
            err = engine_error(e)
            yield event("error", code=err.code, message=err.message, param=err.param)
        finally:
            await outputs.aclose()
