"""Which sequences speculate each step, their proposals, and the acceptance counts."""

from __future__ import annotations

from tianxia.engine.sequence import Sequence
from tianxia.config import SpeculativeConfig
from tianxia.engine.spec_decode.ngram import NgramProposer

# steps a sequence proposes nothing after its acceptance rate fell below the floor; the pause
# doubles with each fall in a row, up to 2**MAX_STRIKES times this: a proposer that is always
# wrong then costs a verification every few hundred steps instead of every 16
BACKOFF_STEPS = 16
MAX_STRIKES = 5
# weight of the latest step in a sequence's running acceptance rate
ACCEPTANCE_WEIGHT = 0.5


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft = draft  # DraftModelProposer (method draft_model)
        k = config.num_speculative_tokens
        # vLLM's spec_decode counters: steps that verified proposals, proposed and accepted
        # tokens, and accepted tokens by their position among a step's proposals
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_token_ids`` (and ``draft_probs``) of the running sequences that speculate
        this step; every other running sequence's are cleared."""
        cfg = self.config
        for seq in running:
            seq.spec_token_ids = []
            seq.draft_probs = None
        if cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size:
            return
        todo: list[tuple[Sequence, int]] = []
        for seq in running:
            if seq.num_computed_tokens != len(seq) - 1 or not seq.num_output_tokens:
                # a prompt chunk, or a prompt's last token (a prefix hit can leave just that):
                # its step forks the n > 1 siblings and may owe prompt logprobs
                continue
            if seq.spec_backoff:
                seq.spec_backoff -= 1
                continue
            # the proposals and the token after them stay within max_tokens and the context
            k = min(cfg.num_speculative_tokens, self.max_model_len - len(seq))
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            if k >= max(1, cfg.draft_min):
                todo.append((seq, k))
        if not todo:
            return
        if self.ngram is None:
            # the draft model runs once the scheduler has reserved the slots: placeholders here
            for seq, k in todo:
                seq.spec_token_ids = [0] * k
            return
        for seq, k in todo:
            if seq.ngram_index is None:
                seq.ngram_index = self.ngram.new_index()
            seq.spec_token_ids = self.ngram.propose(seq.token_ids, k, seq.ngram_index)
        if cfg.draft_min:
            for seq, _ in todo:
                if len(seq.spec_token_ids) < cfg.draft_min:
                    seq.spec_token_ids = []
                    seq.draft_probs = None

    def fill(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The draft model's proposals for the scheduled sequences that hold placeholders."""
        if self.draft is None:
            return
        seqs = [seq for seq, _ in scheduled if seq.spec_token_ids]
        if seqs:
            self.draft.propose(seqs)

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Count one verification; a sequence whose proposals keep failing stops for a while."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        rate = num_accepted / num_proposed
        seq.spec_acceptance += ACCEPTANCE_WEIGHT * (rate - seq.spec_acceptance)
        floor = self.config.min_acceptance_rate
        if seq.spec_acceptance < floor:
            seq.spec_backoff = BACKOFF_STEPS << min(seq.spec_strikes, MAX_STRIKES)
            seq.spec_strikes += 1
            # one more bad step after the pause sends it back: it restarts just above the floor
            seq.spec_acceptance = min(1.0, floor * 1.5)
        elif rate >= floor:
            seq.spec_strikes = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def stats(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
