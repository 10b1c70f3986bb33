"""Tool calling: validate ``tools`` / ``tool_choice``, build the grammars that force a call, and
parse generated text into OpenAI ``tool_calls``, incrementally, for streams and full responses.

Every parser consumes the generated text in pieces (``feed``) and returns what is new: plain
content, and tool-call deltas in OpenAI's streaming shape (the first delta of a call carries its id
and name, later ones append fragments of its ``arguments``). A full response runs the same parser
over the whole text, so streamed and full responses always agree.

Arguments are streamed as the raw JSON text the model writes: a small scanner follows the JSON
object of a call and knows, at each point, which characters belong to its arguments value, so the
concatenated fragments are exactly that value's text.

Formats:

- ``hermes`` (Qwen2.5, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, with plain content around them.
- ``llama3_json`` (Llama 3.1/3.2): the whole message is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``; anything else is content.
- ``tool_choice="required"``: the output is constrained to a JSON array of
  ``{"name": ..., "parameters": ...}`` objects (vLLM's format), one per call.
- a named function: the output is constrained to that function's arguments object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSER_NAMES = ("hermes", "llama3_json")
_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_WS = " \t\n\r"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """An invalid ``tools``, ``tool_choice`` or tool message, with the field it concerns."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None if it has none we know."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3_json"
    return None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --- request validation -----------------------------------------------------------------------


@dataclass
class ToolChoice:
    """What a request asks of the model: ``none``, ``auto``, ``required`` or ``named``."""

    mode: str
    tools: list[dict[str, Any]]  # the ``function`` objects, validated
    name: str | None = None  # the function a named choice forces
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        for f in self.tools:
            if f["name"] == name:
                return f.get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema that constrains decoding (``required`` and named), else None."""
        if self.mode == "named":
            assert self.name is not None
            return self.parameters(self.name)
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": f.get("parameters") or _EMPTY_PARAMETERS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def _check_schema(schema: Any, param: str) -> None:
    import jsonschema

    if not isinstance(schema, dict):
        raise ToolError(f"{param} must be a JSON schema object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ToolError(
            f"{param} is not a valid JSON schema: {e.message}"
            + (f" (at {where})" if where else ""),
            param,
        ) from None


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The ``function`` objects of OpenAI's ``tools``; raises ``ToolError`` on anything invalid."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of tools", "tools")
    functions: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f'{where}.type must be "function"', f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ToolError(
                f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got "
                f"{name!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise ToolError(
                f"{where}.function.name {name!r} is defined twice", f"{where}.function.name"
            )
        seen.add(name)
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"{where}.function.parameters")
        functions.append(fn)
    return functions


def parse_tool_choice(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolChoice | None:
    """Validate a request's tool fields; None when it has no tools (or uses none of them)."""
    if not tools:
        if tool_choice is not None:
            raise ToolError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    functions = validate_tools(tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice("auto", functions, parallel=parallel)
    if tool_choice == "none":
        return ToolChoice("none", functions, parallel=parallel)
    if tool_choice == "required":
        return ToolChoice("required", functions, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice.function.name must be a string", "tool_choice")
        if name not in {f["name"] for f in functions}:
            raise ToolError(
                f"tool_choice names function {name!r}, which is not in tools", "tool_choice"
            )
        return ToolChoice("named", functions, name=name, parallel=parallel)
    raise ToolError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}, got ' + json.dumps(tool_choice)[:100],
        "tool_choice",
    )


def normalize_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Turn assistant ``tool_calls`` arguments given as JSON text into objects, in place: chat
    templates write them with ``tojson``, which would otherwise quote the text a second time."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or calls is None:
            continue
        if not isinstance(calls, list):
            raise ToolError(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolError(f"{where}.function.name is required", f"{where}.function")
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise ToolError(
                        f"{where}.function.arguments is not valid JSON: {e}",
                        f"{where}.function.arguments",
                    ) from None


# --- scanning JSON as it is generated ---------------------------------------------------------


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """The index after the string starting at ``s[i] == '"'``, or None if it is not closed yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(s: str, i: int) -> tuple[int, bool]:
    """Where the JSON value starting at ``i`` ends (so far), and whether it is complete."""
    c = s[i]
    if c == '"':
        end = _string_end(s, i)
        return (end, True) if end is not None else (len(s), False)
    if c in "{[":
        depth = 0
        j = i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = _string_end(s, j)
                if end is None:
                    return len(s), False
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1, True
            j += 1
        return len(s), False
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j, j < len(s)  # a number or literal ends only when something follows it


@dataclass
class _ObjectScan:
    name: str | None = None
    args: tuple[int, int, bool] | None = None  # start, end so far, complete
    end: int | None = None  # index after the closing brace, once closed
    error: bool = False  # not (the start of) a JSON object


def _scan_object(s: str, start: int, arg_keys: tuple[str, ...]) -> _ObjectScan:
    """Follow the (possibly unfinished) JSON object at ``s[start:]`` one level deep."""
    out = _ObjectScan()
    i = _skip_ws(s, start)
    if i >= len(s):
        return out
    if s[i] != "{":
        out.error = True
        return out
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return out
        c = s[i]
        if c == "}":
            out.end = i + 1
            return out
        if c == ",":
            i += 1
            continue
        if c != '"':
            out.error = True
            return out
        key_end = _string_end(s, i)
        if key_end is None:
            return out
        try:
            key = json.loads(s[i:key_end])
        except json.JSONDecodeError:
            out.error = True
            return out
        i = _skip_ws(s, key_end)
        if i >= len(s):
            return out
        if s[i] != ":":
            out.error = True
            return out
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return out
        end, complete = _value_end(s, i)
        if key == "name" and complete and s[i] == '"':
            try:
                out.name = json.loads(s[i:end])
            except json.JSONDecodeError:
                out.error = True
                return out
        elif key in arg_keys and out.args is None:
            out.args = (i, end, complete)
        if not complete:
            return out
        i = end


# --- streaming parsers ------------------------------------------------------------------------


@dataclass
class ParsedDelta:
    """What one piece of generated text adds: content and tool-call deltas (OpenAI's shape)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class _Call:
    """One tool call being streamed from a JSON object in the text."""

    def __init__(self, index: int, arg_keys: tuple[str, ...]) -> None:
        self.index = index
        self.arg_keys = arg_keys
        self.name: str | None = None
        self.args_sent = 0
        self.args_started = False

    def update(self, body: str, start: int = 0) -> tuple[list[dict[str, Any]], _ObjectScan]:
        scan = _scan_object(body, start, self.arg_keys)
        deltas: list[dict[str, Any]] = []
        if self.name is None and scan.name is not None:
            self.name = scan.name
            deltas.append(
                {
                    "index": self.index,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": scan.name, "arguments": ""},
                }
            )
        if self.name is not None and scan.args is not None:
            a0, a1, _ = scan.args
            if a1 > a0 + self.args_sent:
                deltas.append(self._args(body[a0 + self.args_sent : a1]))
                self.args_sent = a1 - a0
                self.args_started = True
        if self.name is not None and scan.end is not None and not self.args_started:
            deltas.append(self._args("{}"))  # a call written without arguments takes none
            self.args_started = True
        return deltas, scan

    def _args(self, text: str) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": text}}


class ToolParser:
    """Incremental parser of one choice's output."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._held_ws = ""  # trailing whitespace of the content, dropped if a call follows

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """Flush at the end of generation."""
        raise NotImplementedError

    def _content(self, text: str) -> str:
        text = self._held_ws + text
        kept = text.rstrip(_WS)
        self._held_ws = text[len(kept) :]
        return kept

    def _flush_ws(self) -> str:
        held, self._held_ws = self._held_ws, ""
        return "" if self.num_calls else held


def _partial_tag_len(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>`` tags. As llama.cpp does for this format, a message that is only a call
    object, bare or in a ```json fence (as small models often write it), is a call too."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _FENCE = re.compile(r"```(?:json)?\s*")

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._call: _Call | None = None
        self._decided = False
        self._bare: _Call | None = None
        self._bare_start = 0
        self._drop_fence = False

    def _decide(self) -> None:
        s = self._buf.lstrip(_WS)
        lead = len(self._buf) - len(s)
        if not s or (s.startswith("`") and ("```json".startswith(s) or self._FENCE.fullmatch(s))):
            return  # undecided: nothing yet, or an unfinished fence
        self._decided = True
        fence = self._FENCE.match(s)
        start = lead + (fence.end() if fence else 0)
        if start < len(self._buf) and self._buf[start] == "{":
            self._bare = _Call(0, ("arguments", "parameters"))
            self._bare_start = start

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        if not self._decided:
            self._decide()
            if not self._decided:
                return out
        if self._bare is not None:
            deltas, scan = self._bare.update(self._buf, self._bare_start)
            out.tool_calls.extend(deltas)
            if scan.error or (scan.end is not None and self._bare.name is None):
                self._bare = None  # a JSON answer, not a call: it is content
            elif scan.end is None:
                return out
            else:
                self._bare = None
                self.num_calls += 1
                self._buf = self._buf[scan.end :]
                self._drop_fence = True
        if self._drop_fence:
            self._buf = self._buf.lstrip("`" + _WS)
            if not self._buf:
                return out
            self._drop_fence = False
        while True:
            if self._call is None:
                k = self._buf.find(self.OPEN)
                if k < 0:
                    keep = _partial_tag_len(self._buf, self.OPEN)
                    out.content += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._content(self._buf[:k])
                self._held_ws = ""
                self._buf = self._buf[k + len(self.OPEN) :]
                self._call = _Call(self.num_calls, ("arguments", "parameters"))
                continue
            k = self._buf.find(self.CLOSE)
            body = self._buf if k < 0 else self._buf[:k]
            deltas, _ = self._call.update(body)
            out.tool_calls.extend(deltas)
            if k < 0:
                return out
            out.extend(self._end_call(body))
            self._buf = self._buf[k + len(self.CLOSE) :]

    def _end_call(self, body: str) -> ParsedDelta:
        call, self._call = self._call, None
        assert call is not None
        if call.name is None:  # not a call after all: give the text back as content
            return ParsedDelta(self._content(self.OPEN + body + self.CLOSE))
        self.num_calls += 1
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._bare is not None:
            if self._bare.name is None:
                out.content += self._content(self._buf)
            else:
                self.num_calls += 1
            self._bare = None
        elif self._call is not None:
            if self._call.name is None:
                out.content += self._content(self.OPEN + self._buf)
            else:
                self.num_calls += 1
            self._call = None
        elif not self._drop_fence:
            out.content += self._content(self._buf)
        self._buf = ""
        out.content += self._flush_ws()
        return out


class _JsonSequenceParser(ToolParser):
    """Calls written as JSON objects one after another (after ``prefix``, between ``separators``,
    up to ``suffix``)."""

    arg_keys: tuple[str, ...] = ("parameters", "arguments")
    prefix = ""
    separators = ";"
    suffix = ""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._pos: int | None = None  # where the next object starts, once in call mode
        self._call: _Call | None = None
        self._as_content = False

    def _start(self) -> bool:
        """Decide whether the output is calls; False while undecided or when it is content."""
        raise NotImplementedError

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        if self._as_content:
            out.content += self._content(self._buf)
            self._buf = ""
            return out
        if self._pos is None and not self._start():
            if self._as_content:
                out.content += self._content(self._buf)
                self._buf = ""
            return out
        assert self._pos is not None
        while True:
            i = self._pos
            while i < len(self._buf) and self._buf[i] in _WS + self.separators:
                i += 1
            if i >= len(self._buf) or (self.suffix and self._buf[i] == self.suffix):
                return out
            if self._call is None:
                self._call = _Call(self.num_calls, self.arg_keys)
            deltas, scan = self._call.update(self._buf, i)
            out.tool_calls.extend(deltas)
            if scan.error or (scan.end is not None and self._call.name is None):
                # not a call: what remains is content
                self._call = None
                self._as_content = True
                out.content += self._content(self._buf[i:])
                self._buf = ""
                return out
            if scan.end is None:
                return out
            self._call = None
            self.num_calls += 1
            self._pos = scan.end

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._pos is None or (self._call is not None and self._call.name is None):
            start = 0 if self._pos is None else self._pos
            out.content += self._content(self._buf[start:])
        elif self._call is not None:
            self.num_calls += 1
        self._call = None
        self._buf = ""
        out.content += self._flush_ws()
        return out


class Llama3JsonToolParser(_JsonSequenceParser):
    PYTHON_TAG = "<|python_tag|>"

    def _start(self) -> bool:
        s = self._buf.lstrip(_WS)
        if s.startswith(self.PYTHON_TAG):
            s = s[len(self.PYTHON_TAG) :].lstrip(_WS)
        elif self.PYTHON_TAG.startswith(s):
            return False  # undecided (empty, or part of the tag)
        if not s:
            return False
        if s[0] != "{":
            self._as_content = True
            return False
        self._buf = s
        self._pos = 0
        return True


class RequiredToolParser(_JsonSequenceParser):
    """The constrained ``tool_choice="required"`` output: ``[{"name": .., "parameters": ..}, ..]``."""

    arg_keys = ("parameters",)
    separators = ","
    suffix = "]"

    def _start(self) -> bool:
        s = self._buf.lstrip(_WS)
        if not s:
            return False
        if s[0] != "[":
            self._as_content = True
            return False
        self._buf = s
        self._pos = 1
        return True


class NamedToolParser(ToolParser):
    """The constrained output of a named ``tool_choice``: the arguments object itself."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._id: str | None = None

    def _open(self, out: ParsedDelta) -> None:
        if self._id is None:
            self._id = new_call_id()
            self.num_calls = 1
            out.tool_calls.append(
                {
                    "index": 0,
                    "id": self._id,
                    "type": "function",
                    "function": {"name": self.name, "arguments": ""},
                }
            )

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._open(out)
        if text:
            out.tool_calls.append({"index": 0, "function": {"arguments": text}})
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._open(out)
        return out


def make_parser(choice: ToolChoice, parser_name: str | None) -> ToolParser | None:
    """The parser for a request's output; None when its output is plain content."""
    if choice.mode == "named":
        assert choice.name is not None
        return NamedToolParser(choice.name)
    if choice.mode == "required":
        return RequiredToolParser()
    if choice.mode == "auto":
        if parser_name == "hermes":
            return HermesToolParser()
        if parser_name == "llama3_json":
            return Llama3JsonToolParser()
    return None


def coalesce_tool_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One delta per call ``index``, in order of first appearance: a call's opening delta (id and
    name) and its first fragment of arguments become one. OpenAI and vLLM send at most one delta
    per index in a chunk, and clients that read ``delta.tool_calls[0]`` lose the others."""
    out: dict[int, dict[str, Any]] = {}
    for d in deltas:
        cur = out.get(d["index"])
        if cur is None:
            out[d["index"]] = {**d, "function": dict(d.get("function", {}))}
            continue
        fn = d.get("function", {})
        for key in ("id", "type"):
            if key in d:
                cur.setdefault(key, d[key])
        if "name" in fn:
            cur["function"].setdefault("name", fn["name"])
        if "arguments" in fn:
            cur["function"]["arguments"] = cur["function"].get("arguments", "") + fn["arguments"]
    return list(out.values())


def merge_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas, joined into complete calls."""
    calls = sorted(coalesce_tool_deltas(deltas), key=lambda d: d["index"])
    return [
        {
            "id": d.get("id") or new_call_id(),
            "type": "function",
            "function": {
                "name": d["function"].get("name", ""),
                "arguments": d["function"].get("arguments", ""),
            },
        }
        for d in calls
    ]
