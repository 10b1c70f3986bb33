"""Request bodies of the OpenAI-compatible API, with OpenAI's field names plus vLLM's extras.

Unknown fields are ignored (as OpenAI does); a field of the wrong type is a 400 in OpenAI's error
shape (see ``server/errors.py``). Every integer is bounded here to what a 64-bit signed integer
holds (the torch tensors it may end up in; vLLM bounds ``seed`` the same way), so a larger one is
a 400 naming the field rather than an overflow deeper in; the ranges that depend on the model or
the field's meaning are checked where the value is used (``SamplingParams`` and the serving
code), so the messages name the field the client sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class JSONSchemaFormat(_Base):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Base):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: Int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: Int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int] | None = None
    # structured output: vLLM's object, its older guided_* fields, and OpenAI's response_format
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's: mixed into the prefix-cache key, so requests with other salts share no cached blocks
    cache_salt: str | None = Field(default=None, min_length=1, max_length=512)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool | None = False
    best_of: Int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True


class ChatMessage(_Base):
    model_config = ConfigDict(
        extra="allow"
    )  # name, tool_calls, tool_call_id, ... reach the template

    role: str
    content: str | list[dict[str, Any]] | None = None

class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    # checked in ``server/tool_parsers.py``, so errors name the offending tool
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = False
    echo: bool | None = False


class TokenizeCompletionRequest(_Base):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Base):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[Int]


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class EmbeddingRequest(_Base):
    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: str = "float"
    dimensions: Int | None = None
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    normalize: bool | None = None


class ResponsesRequest(_Base):
    """OpenAI's Responses API (``POST /v1/responses``): the fields tianxia serves."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
