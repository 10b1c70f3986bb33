"""Compile constraints once, match them per sequence, mask the whole batch each step.

The tokenizer info (every token's bytes) is built once per engine; compiled grammars are cached by
their kind and text. Each constrained sequence owns an ``xgrammar.GrammarMatcher`` that follows the
tokens it accepts; each step the matchers of all constrained rows fill one packed bitmask, which is
applied to the logits in torch before any other processing, so a constrained request can only ever
produce text its grammar accepts. Constraints that do not compile are errors (fail closed).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

_CACHE_SIZE = 256


@dataclass
class StructuredOutputsParams:
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {set_fields or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def key(self) -> tuple[str, str]:
        """A hashable description, the key of the compiled-grammar cache."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


def _choice_ebnf(choices: list[str]) -> str:
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alternatives}"


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; raises ``ValueError`` saying why a constraint is invalid."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind, text = key
        try:
            if kind == "json":
                schema = json.loads(text)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be an object")
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            elif kind == "json_object":
                # OpenAI's json_object promises an object, not any JSON value (vLLM does the same).
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(_choice_ebnf(json.loads(text)))
            else:
                compiled = self.compiler.compile_grammar(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"invalid {kind.replace('_', ' ')} constraint: {first_line}") from None
        if not self._admits_a_first_token(compiled):
            raise ValueError(
                f"the {kind.replace('_', ' ')} constraint cannot be met: no token of this model's "
                "vocabulary can start it"
            )
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _admits_a_first_token(self, compiled: Any) -> bool:
        # A pattern built of characters the vocabulary cannot spell would otherwise fail the
        # request on its first step; an empty pattern admits the stop token, so it passes.
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Mask ``logits`` in place: row ``rows[i]`` may only take tokens ``matchers[i]`` allows."""
        bitmask = self.xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        self.xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows
        )
