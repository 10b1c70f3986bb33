"""``RuntimeEndpoint``: a ``tianxia serve`` server over HTTP.

Prompts are sent as token ids (``/v1/completions`` takes them), tokenized with the server's
``/tokenize``, so that every call starts with exactly the ids of the state's earlier calls and
the server's prefix cache finds them. Roles are rendered with the server's chat template (through
``/tokenize`` with messages, then ``/detokenize``). ``select`` asks for the prompt log-probabilities
of every ``prefix + choice`` in one request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from tianxia.lang.backend.tokens import TokenStateBackend
from tianxia.lang.chat_template import ChatTemplate, JinjaChatTemplate, get_chat_template
from tianxia.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from tianxia.lang.ir import SglSamplingParams


class HTTPBackendError(RuntimeError):
    pass


def check(res: httpx.Response) -> dict[str, Any]:
    if res.status_code != 200:
        try:
            body = res.json()
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        except ValueError:
            message = None
        raise HTTPBackendError(f"{res.request.method} {res.request.url} -> {res.status_code}: {message or res.text[:500]}")
    return res.json()


def sse_events(res: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in res.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise HTTPBackendError(str(event["error"]))
        yield event


def usage_meta(event: dict[str, Any]) -> dict[str, Any]:
    """The token counts of a stream's final usage chunk, in a gen's meta info."""
    usage = event.get("usage") or {}
    return {"prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens")}


class RuntimeEndpoint(TokenStateBackend):
    """``RuntimeEndpoint("http://127.0.0.1:8000", api_key=None)``."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: Any = None,
        chat_template_name: str | None = None,
        *,
        model: str | None = None,
        timeout: float = 600.0,
        block_size: int = 16,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            verify=True if verify is None else verify,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )
        models = check(self.client.get("/v1/models"))["data"]
        self.model = model or models[0]["id"]
        self.model_info = {"model_path": self.model}
        self.block_size = block_size
        if chat_template_name is not None:
            self.chat_template: ChatTemplate = get_chat_template(chat_template_name)
        else:
            self.chat_template = JinjaChatTemplate(self._render_chat, name="server")

    # --- tokenizer over HTTP ------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        return check(self.client.post("/tokenize", json=body))["tokens"]

    def _decode(self, ids: list[int]) -> str:
        return check(self.client.post("/detokenize", json={"model": self.model, "tokens": ids}))["prompt"]

    def _render_chat(self, messages: list[dict[str, Any]]) -> str:
        body = {"model": self.model, "messages": messages, "add_generation_prompt": False}
        ids = check(self.client.post("/tokenize", json=body))["tokens"]
        return self._decode(ids)

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return check(self.client.post("/v1/completions", json={"model": self.model, **body}))

    # --- the backend API ----------------------------------------------------------------------

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_name(self) -> str:
        return self.model

    @staticmethod
    def _meta(obj: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        usage = obj.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        info: dict[str, Any] = {"type": choice.get("finish_reason")}
        if choice.get("stop_reason") is not None:
            info["matched"] = choice["stop_reason"]
        return {
            "id": obj.get("id"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens"),
            "finish_reason": info,
        }

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        ids, _ = self.prompt_ids(s)
        text = s.text_
        obj = self._complete({"prompt": ids, **sampling_params.to_openai_kwargs()})
        choice = obj["choices"][0]
        # the server does not return output token ids: the generated text is tokenized with the
        # text that follows it (its blocks are usually still found: BPE output re-tokenizes alike)
        self.remember(s, text, ids)
        return choice["text"], self._meta(obj, choice)

    def generate_stream(self, s, sampling_params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        ids, _ = self.prompt_ids(s)
        text = s.text_
        body = {
            "model": self.model, "prompt": ids, "stream": True,
            "stream_options": {"include_usage": True}, **sampling_params.to_openai_kwargs(),
        }
        with self.client.stream("POST", "/v1/completions", json=body) as res:
            if res.status_code != 200:
                res.read()
                check(res)
            meta: dict[str, Any] = {}
            for event in sse_events(res):
                for choice in event.get("choices") or []:
                    meta = self._meta(event, choice)
                    if choice.get("text"):
                        yield choice["text"], meta
                if not event.get("choices") and event.get("usage"):
                    yield "", {**meta, **usage_meta(event)}  # the final usage chunk
        self.remember(s, text, ids)

    def select(
        self, s, choices: list[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        if temperature > 1e-5:
            raise ValueError("select scores choices greedily; temperature must be 0")
        prefix, _ = self.prompt_ids(s)
        text = s.text_
        with self._tok_lock:
            choice_ids = [self._encode(c, False) for c in choices]
        n = len(prefix)
        prompts = [prefix + c for c in choice_ids]
        if choices_method.requires_unconditional_logprobs:
            prompts += choice_ids
        obj = self._complete({"prompt": prompts, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
        rows = sorted(obj["choices"], key=lambda c: c["index"])

        def logprob(position: dict[str, Any] | None, token: int) -> float | None:
            if not position:
                return None
            entry = position.get(str(token))
            if entry is None:
                raise HTTPBackendError("the server's prompt_logprobs lack the prompt token")
            return entry["logprob"] if isinstance(entry, dict) else float(entry)

        input_token_logprobs = []
        for c, row in zip(choice_ids, rows):
            plp = row.get("prompt_logprobs")
            if plp is None:
                raise HTTPBackendError(f"{self.base_url} did not return prompt_logprobs")
            input_token_logprobs.append([(logprob(plp[n + j], t), t, None) for j, t in enumerate(c)])
        normalized = [sum(x[0] for x in r) / len(r) for r in input_token_logprobs]
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            unconditional = []
            for c, row in zip(choice_ids, rows[len(choices) :]):
                plp = row.get("prompt_logprobs") or []
                unconditional.append([(logprob(plp[j], t) if j < len(plp) else None, t, None) for j, t in enumerate(c)])
        decision = choices_method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=unconditional,
        )
        best = choices.index(decision.decision)
        self.remember_output(s, text, prefix, choice_ids[best], decision.decision)
        return decision

    def _prefill(self, ids: list[int]) -> None:
        self._complete({"prompt": ids, "max_tokens": 1, "temperature": 0})

    def commit_lazy_operations(self, s) -> None:
        ids, known = self.prompt_ids(s)
        if (len(ids) - known) // self.block_size >= 1:
            self._prefill(ids)
            self.remember(s, s.text_, ids)

    def cache_prefix(self, prefix_str: str) -> None:
        self._prefill(self.encode_text(prefix_str, first=True))

    def get_server_info(self) -> dict[str, Any]:
        return check(self.client.get("/version"))

    def shutdown(self) -> None:
        self.client.close()
