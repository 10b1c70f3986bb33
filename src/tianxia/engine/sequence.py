"""A sequence being generated, and its life cycle."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from tianxia.layers.sampler import sampling_terms
from tianxia.sampling_params import SamplingParams

_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Tokens (prompt then output), how many of them the KV cache holds, and the blocks holding them.

    With a sliding window, the block table's leading entries can be the block manager's null block:
    positions no attention layer reads any more, whose blocks were given back.

    After a recompute preemption the output tokens stay in ``token_ids`` and are prefilled again
    with the prompt; ``num_prompt_tokens`` still marks where the output starts.
    """

    __slots__ = (
        "seq_id", "request_id", "index", "prompt", "token_ids", "num_prompt_tokens", "params",
        "status", "num_computed_tokens", "block_table", "num_cached_tokens", "finish_reason",
        "stop_reason", "arrival_time", "first_token_time", "generator", "detok", "bad_words_ids",
        "logprobs", "cumulative_logprob", "prompt_logprobs", "pending_forks", "compiled_grammar",
        "grammar", "block_keys", "cache_salt", "sample_seed", "spec_token_ids", "draft_probs", "draft_num_computed",
        "spec_acceptance", "spec_backoff", "spec_strikes", "ngram_index", "lora_name", "lora_slot",
        "_prompt_ids", "sent_tokens", "prompt_sent", "sampling_terms",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
    ) -> None:
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # the prompt never changes: one list, not a slice of token_ids for every output
        self._prompt_ids = list(prompt_token_ids)
        self.params = params
        self.sampling_terms = sampling_terms(params)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # prefix-cache keys of the first full blocks (the block manager's chain; kept here because
        # a sliding window gives blocks back, and their keys with them, while the chain goes on)
        self.block_keys: list[bytes] = []
        # mixed into the first block's prefix-cache key: requests with different salts (tenants)
        # never share cached blocks (vLLM's ``cache_salt``)
        self.cache_salt = b""
        # the LoRA adapter (its name, and the engine's slot for it; -1: the base model)
        self.lora_name: str | None = None
        self.lora_slot = -1
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.generator: torch.Generator | None = None
        self.sample_seed: int | None = None
        if params.seed is not None:
            # each of the n sequences of a seeded request gets its own stream, as in vLLM: on a
            # CPU from this generator, on a GPU from a hash of (sample_seed, position)
            self.sample_seed = (params.seed + index) % 2**64
            self.generator = torch.Generator().manual_seed(self.sample_seed)
        self.detok = None  # set by the engine (IncrementalDetokenizer)
        self.bad_words_ids: list[list[int]] = []
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[dict | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        # for n > 1: how many sibling sequences to fork off once the prompt is computed
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.compiled_grammar = None  # xgrammar CompiledGrammar of a constrained request
        self.grammar = None  # this sequence's GrammarMatcher
        # speculative decoding: tokens proposed for this step (verified after its last token),
        # the draft model's distributions they were drawn from ([k, vocab], None when proposals
        # are deterministic), and how many positions the draft model's KV cache holds
        self.spec_token_ids: list[int] = []
        self.draft_probs = None
        self.draft_num_computed = 0
        # a running average of the fraction of proposals accepted, steps left without any, and
        # how many pauses in a row it has earned (each twice as long as the last)
        self.spec_acceptance = 1.0
        self.spec_backoff = 0
        self.spec_strikes = 0
        self.ngram_index = None  # the prompt lookup's n-gram positions of this sequence
        # what a server has been sent of it (``output_processor.request_delta``): output tokens,
        # and whether the prompt went with the request's first delta (first sequence only)
        self.sent_tokens = 0
        self.prompt_sent = False

    def fork(self, index: int) -> Sequence:
        """A sibling for parallel sampling: same tokens and blocks (the caller adds block refs)."""
        child = Sequence(self.request_id, self.prompt, self.prompt_token_ids, self.params, index)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_table = list(self.block_table)
        child.block_keys = list(self.block_keys)
        child.cache_salt = self.cache_salt
        child.lora_name, child.lora_slot = self.lora_name, self.lora_slot
        child.num_cached_tokens = self.num_cached_tokens
        child.arrival_time = self.arrival_time
        child.bad_words_ids = self.bad_words_ids
        child.compiled_grammar = self.compiled_grammar
        child.prompt_logprobs = None  # reported once, by the first sequence
        child.status = self.status
        return child

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prefix_key_extra(self) -> bytes:
        """What the first block's prefix-cache key mixes in besides tokens: the cache salt and
        the adapter, whose K/V differs from the base's for the same tokens."""
        if self.lora_slot < 0:
            return self.cache_salt
        return self.cache_salt + b"\0lora:" + str(self.lora_slot).encode()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
