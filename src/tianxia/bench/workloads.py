"""Benchmark workloads: the prompts sent and the output length asked of each.

- ``random``: prompts of exactly N tokens (by the given tokenizer) made of random whole words,
  N fixed or drawn uniformly from a range; output lengths likewise.
- ``prefix``: one (or a few) shared prefixes of a given length ("system prompt") followed by a
  random suffix; with ``--endpoint chat`` the prefix is the system message.
- ``multi-turn``: conversations, each opening with one of ``num_prefixes`` shared system prompts
  and sending ``num_turns`` user turns in order; each turn's request carries the whole history
  (the earlier turns and the server's replies), so it extends the last one's prompt (SGLang's
  generated-shared-prefix and multi-turn benchmarks). Only the user turns are drawn here; the
  history is filled in at run time (:mod:`tianxia.bench.serve`).
- ``file``: prompts from a local JSON / JSONL file. Each item may be a string, an object with
  ``prompt`` (and optionally ``output_len`` / ``max_tokens``), an OpenAI-style ``messages`` list or
  a ShareGPT ``conversations`` list (``{"from": "human"|"gpt", "value": ...}``); for the last two
  the first user turn is the prompt and the reply that follows it, measured in tokens, is the
  output length unless ``--output-len`` is given.
"""

from __future__ import annotations

import json
import random as _random
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 64


@dataclass
class BenchRequest:
    """One request of a workload, endpoint-agnostic: ``prompt`` text plus an optional system part."""

    index: int
    prompt: str
    output_len: int
    system: str | None = None  # shared prefix (prefix workload)
    input_len: int | None = None  # prompt tokens by our tokenizer (None: no tokenizer)
    messages: list[dict[str, str]] | None = None  # from a chat-format file, used as-is for chat
    extra: dict[str, Any] = field(default_factory=dict)
    conversation: int | None = None  # multi-turn: which conversation, and its turn
    turn: int = 0
    history: list[tuple[str, str]] = field(default_factory=list)  # earlier (user turn, reply)

    def completion_prompt(self) -> str:
        if self.conversation is None:
            return (self.system or "") + self.prompt
        # each turn's prompt is the last one's plus the reply the server gave to it
        past = "".join(f"\n\nUser: {user}\nAssistant:{reply}" for user, reply in self.history)
        return f"{self.system or ''}{past}\n\nUser: {self.prompt}\nAssistant:"

    def chat_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return self.messages
        msgs = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        for user, reply in self.history:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        msgs.append({"role": "user", "content": self.prompt})
        return msgs


# ----------------------------------------------------------------------------- lengths


@dataclass(frozen=True)
class LenSpec:
    """A token length: fixed (``lo == hi``) or uniform over ``[lo, hi]``."""

    lo: int
    hi: int

    def sample(self, rng: _random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"

    def to_json(self) -> int | list[int]:
        return self.lo if self.lo == self.hi else [self.lo, self.hi]


_LEN_RE = re.compile(r"^\s*(\d+)\s*(?:[:,-]|\.\.)\s*(\d+)\s*$")


def parse_len(text: str | int) -> LenSpec:
    """``"128"`` (fixed) or ``"96:160"`` / ``"96-160"`` / ``"96..160"`` (uniform, inclusive)."""
    if isinstance(text, int):
        lo = hi = text
    else:
        m = _LEN_RE.match(text)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
        else:
            try:
                lo = hi = int(text)
            except ValueError:
                raise ValueError(f"bad length {text!r}: use N or LO:HI") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"bad length {text!r}: need 0 <= LO <= HI")
    return LenSpec(lo, hi)


# ----------------------------------------------------------------------------- tokenizer text


class WordSampler:
    """Builds text of exactly N tokens from random whole-word vocabulary entries.

    The pool holds tokens that decode to a space plus 2+ ASCII letters and encode back to
    themselves, so concatenations re-tokenize (almost always) to the same count; the final length
    is checked with the tokenizer and adjusted a word at a time.
    """

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        vocab = tokenizer.get_vocab()
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = sorted(i for i in vocab.values() if i not in special)
        texts = tokenizer.batch_decode([[i] for i in ids])
        cand = [(i, t) for i, t in zip(ids, texts) if re.fullmatch(r" [A-Za-z]{2,12}", t)]
        if len(cand) < 50:
            raise ValueError("tokenizer has too few whole-word tokens to build random prompts")
        enc = tokenizer([t for _, t in cand], add_special_tokens=False)["input_ids"]
        self.words = [t for (i, t), e in zip(cand, enc) if e == [i]]
        if len(self.words) < 50:
            raise ValueError("tokenizer has too few whole-word tokens to build random prompts")

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def text(self, n: int, rng: _random.Random) -> str:
        if n <= 0:
            return ""
        words = [rng.choice(self.words) for _ in range(n)]
        for _ in range(4 * n + 20):
            text = "".join(words)
            c = self.count(text)
            if c == n:
                return text
            if c > n:
                words.pop()
            else:
                words.extend(rng.choice(self.words) for _ in range(n - c))
        raise ValueError(f"could not build a prompt of exactly {n} tokens")


_SAMPLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def word_sampler(tokenizer) -> WordSampler:
    """One :class:`WordSampler` per tokenizer (building one scans the vocabulary: seconds)."""
    try:
        ws = _SAMPLERS.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return WordSampler(tokenizer)
    if ws is None:
        ws = _SAMPLERS[tokenizer] = WordSampler(tokenizer)
    return ws


# ----------------------------------------------------------------------------- workloads


def random_workload(
    tokenizer, num_prompts: int, input_len: LenSpec, output_len: LenSpec, seed: int
) -> list[BenchRequest]:
    if tokenizer is None:
        raise ValueError("the random workload needs a tokenizer: pass --tokenizer MODEL")
    rng = _random.Random(seed)
    ws = word_sampler(tokenizer)
    out = []
    for i in range(num_prompts):
        n = input_len.sample(rng)
        out.append(BenchRequest(i, ws.text(n, rng), output_len.sample(rng), input_len=n))
    return out


def _shared_prefixes(workload: str, tokenizer, prefix_len: int, num_prefixes: int,
                     rng: _random.Random) -> tuple[WordSampler, list[str]]:
    """The word sampler of ``tokenizer`` and ``num_prefixes`` texts of ``prefix_len`` tokens."""
    if tokenizer is None:
        raise ValueError(f"the {workload} workload needs a tokenizer: pass --tokenizer MODEL")
    ws = word_sampler(tokenizer)
    return ws, [ws.text(prefix_len, rng) for _ in range(max(1, num_prefixes))]


def prefix_workload(
    tokenizer, num_prompts: int, prefix_len: int, suffix_len: LenSpec, output_len: LenSpec,
    seed: int, num_prefixes: int = 1,
) -> list[BenchRequest]:
    """``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each request one of them + suffix."""
    rng = _random.Random(seed)
    ws, prefixes = _shared_prefixes("prefix", tokenizer, prefix_len, num_prefixes, rng)
    out = []
    for i in range(num_prompts):
        p = prefixes[i % len(prefixes)]
        n = suffix_len.sample(rng)
        s = ws.text(n, rng)
        out.append(BenchRequest(i, s, output_len.sample(rng), system=p,
                                input_len=ws.count(p + s), extra={"prefix": i % len(prefixes)}))
    return out


def multi_turn_workload(
    tokenizer, num_prompts: int, num_turns: int, prefix_len: int, turn_len: LenSpec,
    output_len: LenSpec, seed: int, num_prefixes: int = 1,
) -> list[BenchRequest]:
    """``ceil(num_prompts / num_turns)`` conversations of ``num_turns`` turns (the last one may be
    shorter), conversation ``c`` opening with system prompt ``c % num_prefixes``; ordered
    conversation by conversation."""
    if num_turns < 1:
        raise ValueError("--num-turns must be at least 1")
    rng = _random.Random(seed)
    ws, prefixes = _shared_prefixes("multi-turn", tokenizer, prefix_len, num_prefixes, rng)
    out = []
    for i in range(num_prompts):
        conv, turn = divmod(i, num_turns)
        out.append(BenchRequest(i, ws.text(turn_len.sample(rng), rng), output_len.sample(rng),
                                system=prefixes[conv % len(prefixes)], conversation=conv,
                                turn=turn, extra={"prefix": conv % len(prefixes)}))
    return out


def _load_items(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(text)
    elif stripped.startswith("{") and path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):  # {"data": [...]} / {"prompts": [...]}
        for key in ("data", "prompts", "items", "conversations"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            data = [data]
    return data


def _parse_item(item: Any) -> tuple[str, list[dict] | None, str | None, int | None] | None:
    """-> (prompt, chat messages or None, reference reply or None, explicit output length)."""
    if isinstance(item, str):
        return (item, None, None, None) if item.strip() else None
    if not isinstance(item, dict):
        return None
    explicit = item.get("output_len", item.get("max_tokens"))
    explicit = int(explicit) if explicit is not None else None
    if isinstance(item.get("prompt"), str):
        ref = item.get("completion") or item.get("response")
        return item["prompt"], None, ref if isinstance(ref, str) else None, explicit
    turns = item.get("conversations") or item.get("conversation")
    if isinstance(turns, list):
        msgs = []
        for t in turns:
            if not isinstance(t, dict):
                continue
            who = str(t.get("from", t.get("role", ""))).lower()
            role = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                    "system": "system"}.get(who)
            content = t.get("value", t.get("content"))
            if role and isinstance(content, str):
                msgs.append({"role": role, "content": content})
        item = {"messages": msgs, "output_len": explicit}
    msgs = item.get("messages")
    if isinstance(msgs, list):
        ui = next((k for k, m in enumerate(msgs) if m.get("role") == "user"), None)
        if ui is None or not str(msgs[ui].get("content") or "").strip():
            return None
        ref = msgs[ui + 1]["content"] if ui + 1 < len(msgs) and \
            msgs[ui + 1].get("role") == "assistant" else None
        return msgs[ui]["content"], msgs[: ui + 1], ref, explicit
    return None


def file_workload(
    path: str | Path, tokenizer, num_prompts: int, output_len: LenSpec | None, seed: int,
    max_input_len: int | None = None, min_output_len: int = 4, max_output_len: int = 1024,
) -> list[BenchRequest]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file not found: {path}")
    items = [p for p in (_parse_item(x) for x in _load_items(path)) if p is not None]
    if not items:
        raise ValueError(f"no usable prompts in {path} (expected strings, {{'prompt': ...}}, "
                         "'messages' or ShareGPT 'conversations')")
    rng = _random.Random(seed)
    rng.shuffle(items)
    out: list[BenchRequest] = []
    i = 0
    while len(out) < num_prompts:
        if i >= len(items) * 2 and not out:
            raise ValueError(f"no prompt in {path} passes the length filters")
        prompt, msgs, ref, explicit = items[i % len(items)]
        i += 1
        n_in = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if tokenizer else None
        if max_input_len is not None and n_in is not None and n_in > max_input_len:
            continue
        if output_len is not None:
            n_out = output_len.sample(rng)
        elif explicit is not None:
            n_out = explicit
        elif ref is not None and tokenizer is not None:
            n_out = len(tokenizer(ref, add_special_tokens=False)["input_ids"])
            if n_out < min_output_len:
                continue
            n_out = min(n_out, max_output_len)
        else:
            n_out = DEFAULT_OUTPUT_LEN
        out.append(BenchRequest(len(out), prompt, max(1, n_out), input_len=n_in, messages=msgs))
    return out
