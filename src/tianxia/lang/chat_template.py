"""Role prefixes and suffixes for ``system()`` / ``user()`` / ``assistant()``.

SGLang keeps a table of hand-written templates; tianxia renders the model's own Jinja chat
template instead. For a role, given the roles of the messages before it, the template is
rendered once without and once with a message whose content is a placeholder; the text the new
message added, split at the placeholder, is the role's prefix and suffix. So a template that
inserts a default system prompt before the first user message (SmolLM2's does) puts it in that
user message's prefix, and ``s.text()`` is exactly what ``apply_chat_template`` would render for
``s.messages()``.

Contents of earlier messages are replaced by placeholders too, so a prefix depends only on the
roles; results are cached per ``(role, earlier roles)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_CONTENT = "TIANXIAROLECONTENT"
_HISTORY = "TIANXIAHISTORY{}X"


class ChatTemplate:
    """``get_prefix_and_suffix(role, earlier_messages) -> (prefix, suffix)``."""

    name = "template"
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict[str, Any]]) -> tuple[str, str]:
        raise NotImplementedError


class FixedChatTemplate(ChatTemplate):
    """A fixed prefix and suffix per role (``default`` and ``chatml`` below)."""

    def __init__(
        self,
        name: str,
        roles: dict[str, tuple[str, str]],
        default_system_prompt: str | None = None,
        stop_str: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.roles = roles
        self.default_system_prompt = default_system_prompt
        self.stop_str = stop_str

    def get_prefix_and_suffix(self, role, hist_messages):
        if role not in self.roles:
            raise ValueError(f"the {self.name!r} chat template has no role {role!r}")
        return self.roles[role]


class JinjaChatTemplate(ChatTemplate):
    """Prefixes and suffixes measured from a renderer ``render(messages) -> text``."""

    def __init__(self, render: Callable[[list[dict[str, Any]]], str], name: str = "jinja") -> None:
        self.name = name
        self._render = render
        self._cache: dict[tuple, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def _safe_render(self, messages: list[dict[str, Any]]) -> str:
        if not messages:
            return ""
        try:
            return self._render(messages)
        except Exception:  # noqa: BLE001 - e.g. a template that needs a user message first
            return ""

    def get_prefix_and_suffix(self, role, hist_messages):
        key = (role, tuple(m["role"] for m in hist_messages))
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        hist = [{"role": r, "content": _HISTORY.format(i)} for i, r in enumerate(key[1])]
        before = self._safe_render(hist)
        try:
            full = self._render(hist + [{"role": role, "content": _CONTENT}])
        except Exception as e:
            raise ValueError(
                f"the chat template cannot render a {role!r} message after {list(key[1])}: {e}"
            ) from e
        at = full.rfind(_CONTENT)
        if at < 0:
            raise ValueError(f"the chat template drops the content of {role!r} messages")
        common = 0
        limit = min(len(before), at)
        while common < limit and full[common] == before[common]:
            common += 1
        result = (full[common:at], full[at + len(_CONTENT) :])
        with self._lock:
            self._cache[key] = result
        return result


def jinja_renderer(
    template: str, bos_token: str = "", eos_token: str = "", **extra: Any
) -> Callable[[list[dict[str, Any]]], str]:
    """Render a Hugging Face style chat template with jinja2 (as transformers does)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)

    def render(messages: list[dict[str, Any]]) -> str:
        return compiled.render(
            messages=messages, add_generation_prompt=False, bos_token=bos_token,
            eos_token=eos_token, **extra,
        )

    return render


DEFAULT = FixedChatTemplate(
    "default",
    {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
)
CHATML = FixedChatTemplate(
    "chatml",
    {
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    },
    stop_str=("<|im_end|>",),
)
_BUILTIN = {"default": DEFAULT, "chatml": CHATML}


def get_chat_template(spec: str | ChatTemplate | None) -> ChatTemplate:
    """A builtin name (``default``, ``chatml``), a Jinja template text, or a template object."""
    if spec is None:
        return DEFAULT
    if isinstance(spec, ChatTemplate):
        return spec
    if spec in _BUILTIN:
        return _BUILTIN[spec]
    if "{%" in spec or "{{" in spec:
        return JinjaChatTemplate(jinja_renderer(spec))
    raise ValueError(
        f"unknown chat template {spec!r}: pass 'default', 'chatml' or a Jinja template"
    )
