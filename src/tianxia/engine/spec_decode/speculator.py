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
# the share of the engine's time that failed speculation may cost: a verification that gains less
# than its time (against a plain decode step of the same batch, measured) runs up a debt, and no
# sequence proposes until plain steps have paid it back at this share of their time. Where
# proposals fail on a device whose verification and draft steps cost several plain steps, this
# bounds the loss to about this share plus one attempt; where they pay, the debt stays at zero
TIME_BUDGET = 0.03
# weight of the latest plain step in the running step time of its batch size
STEP_TIME_WEIGHT = 0.2
# verifications that gained time bank it, up to this many plain steps' worth, so that a workload
# whose proposals mostly pay is not paused by its occasional refused one
CREDIT_STEPS = 16


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
        # the speculation time budget: a plain decode step's running seconds per batch size, and
        # the seconds failed speculation has cost beyond what plain steps have paid back
        self.plain_step_s: dict[int, float] = {}
        self.debt_s = 0.0

    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_token_ids`` (and ``draft_probs``) of the running sequences that speculate
        this step; every other running sequence's are cleared."""
        cfg = self.config
        for seq in running:
            seq.spec_token_ids = []
            seq.draft_probs = None
        if cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size:
            return
        # the time budget (a floor of 0: never switched off); a batch size's first decode step
        # runs plain, so that the first verification's cost is measured against a plain step's
        timed_out = cfg.min_acceptance_rate > 0 and (self.debt_s > 0 or len(running) not in self.plain_step_s)
        todo: list[tuple[Sequence, int]] = []
        for seq in running:
            if seq.num_computed_tokens != len(seq) - 1 or not seq.num_output_tokens:
                # a prompt chunk, or a prompt's last token (a prefix hit can leave just that):
                # its step forks the n > 1 siblings and may owe prompt logprobs
                continue
            if seq.spec_backoff:
                seq.spec_backoff -= 1
                continue
            if timed_out and seq.params.seed is None:
                # a seeded request's draws depend on which steps verify: timing must not decide
                # them (its own acceptance rate still does), or the same request would give
                # different answers
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

    def observe(self, seconds: float, num_seqs: int, drafted: bool, accepted: int) -> None:
        """Account one decode step (every sequence decoding or verifying) of ``num_seqs``
        sequences that took ``seconds``: ``drafted`` whether any verified proposals, ``accepted``
        how many proposals were accepted in it."""
        plain = self.plain_step_s.get(num_seqs)
        if not drafted:
            self.plain_step_s[num_seqs] = seconds if plain is None else plain + STEP_TIME_WEIGHT * (seconds - plain)
            if self.debt_s > 0:  # plain steps pay a debt back; they add no credit
                self.debt_s = max(0.0, self.debt_s - TIME_BUDGET * seconds)
        elif plain is not None:
            # what plain steps would have taken for the tokens this step gave every sequence
            waste = seconds - plain * (1 + accepted / num_seqs)
            self.debt_s = max(-CREDIT_STEPS * plain, self.debt_s + waste - TIME_BUDGET * seconds)

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
