"""``OpenAI``: any OpenAI-compatible server (vLLM, llama.cpp's llama-server, tianxia serve, ...).

Prompts are the state's text (the server tokenizes), so prefix reuse is whatever the server's
own prefix cache makes of a growing text. ``select`` needs the log-probabilities of prompt
tokens: it sends ``prefix + choice`` for every choice in one ``/v1/completions`` request with
``echo: true, logprobs: 1, max_tokens: 1`` and averages the log-probabilities of the tokens that
overlap the choice's characters. A server that does not return them (llama.cpp's, chat-only
APIs) gets a clear error instead of a silent guess.

With ``is_chat_model=True`` a gen must come right after ``assistant_begin()``, and the messages
so far go to ``/v1/chat/completions``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx

from tianxia.lang.backend.base import BaseBackend
from tianxia.lang.backend.runtime_endpoint import HTTPBackendError, check, sse_events, usage_meta
from tianxia.lang.chat_template import ChatTemplate, get_chat_template
from tianxia.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from tianxia.lang.ir import SglSamplingParams

INSTRUCT_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")
_OFFICIAL = "https://api.openai.com/v1"


class SelectUnsupportedError(RuntimeError):
    """The server cannot score choices (it returns no prompt log-probabilities)."""


class OpenAI(BaseBackend):
    """``OpenAI(model_name, base_url="http://host:port/v1", api_key=None, is_chat_model=None,
    chat_template=None)``.

    ``is_chat_model`` defaults to False for a ``base_url`` of your own (completions, where
    ``select`` can work) and, on OpenAI's API, to True except for instruct models.
    ``chat_template`` renders roles into the text in completion mode: ``"default"``
    (``USER:``/``ASSISTANT:``), ``"chatml"`` or a Jinja template (the model's own, for exact
    prompts). ``extra_body`` is merged into every request (server-specific fields);
    ``http_client`` replaces the ``httpx.Client`` (tests, proxies).
    """

    def __init__(
        self,
        model_name: str,
        is_chat_model: bool | None = None,
        chat_template: str | ChatTemplate | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        extra_body: dict[str, Any] | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__()
        self.model_name = model_name
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or _OFFICIAL).rstrip("/")
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        if is_chat_model is None:
            is_chat_model = self.base_url == _OFFICIAL and model_name not in INSTRUCT_MODEL_NAMES
        self.is_chat_model = is_chat_model
        self.chat_template = get_chat_template(chat_template)
        self.extra_body = dict(extra_body or {})
        self.client = http_client or httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_name(self) -> str:
        return self.model_name

    # --- requests -----------------------------------------------------------------------------

    def _body(self, s, sp: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        body = {"model": self.model_name, **sp.to_openai_kwargs(), **self.extra_body}
        if not self.is_chat_model:
            return "/completions", {**body, "prompt": s.text_}
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos :].strip():
            raise RuntimeError(
                "with a chat model, gen must come right after assistant_begin() "
                "(or inside assistant(...)), as the reply to the messages so far"
            )
        body.pop("guided_regex", None)
        schema = body.pop("guided_json", None)
        if sp.regex is not None:
            body["guided_regex"] = sp.regex  # vLLM's chat endpoint takes it too
        if schema is not None:
            body["response_format"] = {
                "type": "json_schema", "json_schema": {"name": "output", "schema": schema},
            }
        return "/chat/completions", {**body, "messages": s.messages_}

    @staticmethod
    def _meta(obj: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        usage = obj.get("usage") or {}
        return {
            "id": obj.get("id"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "finish_reason": {"type": choice.get("finish_reason")},
        }

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        path, body = self._body(s, sampling_params)
        obj = check(self.client.post(path, json=body))
        choice = obj["choices"][0]
        text = choice["message"]["content"] if self.is_chat_model else choice["text"]
        return text or "", self._meta(obj, choice)

    def generate_stream(self, s, sampling_params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        path, body = self._body(s, sampling_params)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        with self.client.stream("POST", path, json=body) as res:
            if res.status_code != 200:
                res.read()
                check(res)
            meta: dict[str, Any] = {}
            for event in sse_events(res):
                for choice in event.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content") if self.is_chat_model else choice.get("text")
                    meta = self._meta(event, choice)
                    if delta:
                        yield delta, meta
                if not event.get("choices") and event.get("usage"):
                    yield "", {**meta, **usage_meta(event)}  # the final usage chunk

    def select(
        self, s, choices: list[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        if self.is_chat_model:
            raise SelectUnsupportedError(
                "select needs the log-probabilities of prompt tokens, which chat completion APIs do "
                "not return; use a completion model (is_chat_model=False) or gen(regex=...)"
            )
        if temperature > 1e-5:
            raise ValueError("select scores choices greedily; temperature must be 0")
        if choices_method.requires_unconditional_logprobs:
            raise SelectUnsupportedError("the OpenAI backend supports token_length_normalized and greedy_token_selection")
        prefix = s.text_
        body = {
            "model": self.model_name, "prompt": [prefix + c for c in choices], "max_tokens": 1,
            "temperature": 0, "echo": True, "logprobs": 1, **self.extra_body,
        }
        hint = (
            f"select() needs the log-probabilities of prompt tokens, and {self.base_url} did not "
            "return them for a /completions request with echo=true and logprobs (vLLM and tianxia "
            "serve do; llama.cpp's server does not). Use gen(regex='(a|b)') or the Runtime / "
            "RuntimeEndpoint backends instead."
        )
        try:
            obj = check(self.client.post("/completions", json=body))
        except HTTPBackendError as e:
            raise SelectUnsupportedError(f"{hint} The server said: {e}") from e
        rows = sorted(obj.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(rows) != len(choices):
            raise SelectUnsupportedError(hint)
        input_token_logprobs = []
        start = len(prefix)
        for choice, row in zip(choices, rows):
            lp = row.get("logprobs") or {}
            tokens, values, offsets = lp.get("tokens"), lp.get("token_logprobs"), lp.get("text_offset")
            if not tokens or values is None or offsets is None:
                raise SelectUnsupportedError(hint)
            end = start + len(choice)
            picked = [
                (v, None, t)
                for t, v, o in zip(tokens, values, offsets)
                if o < end and o + max(len(t), 1) > start
            ]
            if not picked or any(v is None for v, _, _ in picked):
                raise SelectUnsupportedError(hint)
            input_token_logprobs.append(picked)
        normalized = [sum(v for v, _, _ in r) / len(r) for r in input_token_logprobs]
        return choices_method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=[[] for _ in choices],
        )

    def shutdown(self) -> None:
        self.client.close()
