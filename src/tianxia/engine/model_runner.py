"""Turns a scheduled step into one flat forward pass, then samples.

The batch is the concatenation of every scheduled sequence's new tokens (no padding), with their
positions, the cache slot each new token's K/V goes to, and each sequence's block table.

This is the one place that picks how a step runs (the *route*, counted in ``route_counts``):

- ``graph``: a step of decodes only, replayed from a CUDA graph of the family's fused decode step
  or, for a family without one, of its module forward (:mod:`tianxia.engine.cuda_graph`);
- ``fused``: a step of decodes only, through the family's fused step called directly (the CPU's
  one-call C++ decoder; a GPU with graphs off);
- ``eager``: the module forward (prompt chunks, mixed steps, batches past a route's limit).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from tianxia.config import CacheConfig, ModelConfig
from tianxia.engine import faults
from tianxia.engine.sequence import Sequence
from tianxia.layers.attention import AttentionMetadata
from tianxia.layers.lora import LoRAState
from tianxia.layers.sampler import Sampler, SamplingBatch
from tianxia.layers.sampler_graphs import DEFAULT_KINDS, SamplerGraphs
from tianxia.quant.kv_blocks import kv_row_bytes

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}

# (top token ids, their logprobs, the chosen token's logprob, its rank)
TokenLogprobs = tuple[list[int], list[float], float, int]


@dataclass(frozen=True)
class RequestFailure:
    """Why a request got no token. ``invalid_request`` when its own parameters are at fault (an
    HTTP client gets a 400), otherwise the server failed it (a 500)."""

    message: str
    invalid_request: bool = False


NO_ADMISSIBLE_TOKEN = (
    "no token of the vocabulary satisfies this request's constraints "
    "(guided decoding, allowed_token_ids, bad_words, min_tokens) at this point"
)


@dataclass
class StepResult:
    tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    errors: dict[int, RequestFailure] = field(default_factory=dict)  # seq_id -> why it got no token
    # sequences that verified proposals: their accepted proposals, then one more token
    accepted: dict[int, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype | str) -> int:
    """K and V bytes of one token over all layers; ``dtype`` a torch dtype or a block format name."""
    row = kv_row_bytes(dtype, config.head_dim) if isinstance(dtype, str) else config.head_dim * _DTYPE_BYTES[dtype]
    return 2 * config.num_hidden_layers * config.num_key_value_heads * row


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        kv_dtype: torch.dtype | str,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.config = model_config
        self.device = device
        self.block_size = cache_config.block_size
        per_block = kv_bytes_per_token(model_config, kv_dtype) * self.block_size
        self.num_blocks = cache_config.num_blocks or max(1, cache_config.kv_cache_memory // per_block)
        # a block format (q8_0, q4_0) keeps each head's row as uint8 blocks (quant/kv_blocks.py)
        blocks = isinstance(kv_dtype, str)
        shape = (
            model_config.num_hidden_layers, 2, self.num_blocks, self.block_size, model_config.num_key_value_heads,
            kv_row_bytes(kv_dtype, model_config.head_dim) if blocks else model_config.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=torch.uint8 if blocks else kv_dtype, device=device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(seed)
        self.eos_ids: tuple[int, ...] = model_config.eos_token_ids
        self.graph_runner = None  # CUDA: decode steps through captured graphs (setup_decode)
        self.decode_step = None  # the family's fused decode step (setup_decode), or None
        self.route_counts: Counter[str] = Counter()  # steps per route: graph, fused, eager
        self.lora: LoRAState | None = None  # the adapters' grouped product (--enable-lora)
        self.fused_lora = False  # whether the fused decode step adds the adapters' deltas itself

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _prepare(self, scheduled: list[tuple[Sequence, int]]):
        # decodes (one new token) first, so the attention backend can batch them densely; then
        # by LoRA adapter, so each adapter's rows are a run its product reads in place
        order = sorted(scheduled, key=lambda x: (x[1] != 1, x[0].lora_slot))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens, query_lens, starts = [], [], [0]
        bs = self.block_size
        for seq, n in order:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            if start + n > len(seq):  # a decode that verifies its proposed tokens
                input_ids.extend(seq.spec_token_ids[: start + n - len(seq)])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            query_lens.append(n)
            starts.append(starts[-1] + n)
        max_blocks = max(len(seq.block_table) for seq, _ in order)
        # one host tensor (ids, positions, slots, lengths, zero-padded block tables) and one copy
        # to the device, instead of a tensor and a transfer each
        flat = input_ids + positions + slots + seq_lens
        for seq, _ in order:
            flat += seq.block_table
            flat += [0] * (max_blocks - len(seq.block_table))
        buf = torch.tensor(flat, dtype=torch.int64).to(self.device)
        T, S = len(input_ids), len(order)
        meta = AttentionMetadata(
            slot_mapping=buf[2 * T : 3 * T],
            block_tables=buf[3 * T + S :].view(S, max_blocks),
            seq_lens=seq_lens,
            query_lens=query_lens,
            query_start_loc=starts,
            num_decodes=sum(1 for n in query_lens if n == 1),
            seq_lens_tensor=buf[3 * T : 3 * T + S],
            block_size=bs,
        )
        return order, buf[:T], buf[T : 2 * T], meta

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        copies: list[tuple[int, int]] = (),
        forks: dict[int, list[Sequence]] | None = None,
    ) -> StepResult:
        """Run one step and sample for every sequence whose tokens are now all computed.

        ``forks`` maps a sequence id to siblings that sample from the same logits row (the
        n > 1 sequences of a request, forked when its prompt is done).
        """
        for src, dst in copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        order, ids, pos, meta = self._prepare(scheduled)
        rows, seqs = [], []
        drafted: list[int] = []  # where the rows of each sequence that verifies proposals start
        for i, (seq, n) in enumerate(order):
            end = seq.num_computed_tokens + n
            if end == len(seq):
                for s in (seq, *(forks or {}).get(seq.seq_id, ())):
                    rows.append(meta.query_start_loc[i + 1] - 1)
                    seqs.append(s)
            elif end > len(seq):  # its last token and n - 1 proposals: every row is sampled
                drafted.append(len(rows))
                rows.extend(range(meta.query_start_loc[i], meta.query_start_loc[i + 1]))
                seqs.extend([seq] * n)
        row_slots = self._lora_rows(order)
        keep = self._rows_to_keep(order, rows, ids.shape[0])
        if row_slots:
            self.lora.begin_step(row_slots, keep)
        try:
            # rows with an adapter take the module forward, whose hooks add the adapters'
            # deltas, unless the fused decode step takes them
            graph_logits = (self._decode_logits(order, ids, pos, meta)
                            if not row_slots or self.fused_lora else None)
            if graph_logits is not None:
                hidden = None
            elif keep is not None:
                hidden = self.model(ids, pos, self.kv_caches, meta,
                                    torch.tensor(keep, dtype=torch.long, device=self.device))
                where = {r: j for j, r in enumerate(keep)}
                rows = [where[r] for r in rows]
            else:
                hidden = self.model(ids, pos, self.kv_caches, meta)
        finally:
            if row_slots:
                self.lora.end_step()
        if hidden is not None:
            self.route_counts["eager"] += 1
        result = StepResult()
        if keep is None:
            self._prompt_logprobs(order, hidden, meta, result)
        if not seqs:
            return result
        if graph_logits is not None:
            same = len(rows) == graph_logits.shape[0] and rows == list(range(len(rows)))
            logits = graph_logits if same else graph_logits[torch.tensor(rows, device=self.device)]
        else:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        nan_rows = self._nan_rows(logits, seqs)
        # on the GPU the NaN rows are looked for after sampling: no host sync between the forward
        # and the sampler, whose batch the host builds (and whose kernels it launches) meanwhile
        deferred = not drafted and logits.is_cuda and self.sampler.samples_on_device(logits)
        if not deferred:
            logits = self._drop_nan_rows(logits, nan_rows, seqs, result)
        if drafted:
            self._verify(logits, seqs, drafted, result)
            return result
        out = self.sampler(logits, SamplingBatch.from_sequences(seqs, self.eos_ids))
        if deferred:
            self._drop_nan_rows(logits, nan_rows, seqs, result)
        for i in out.dead_rows:
            result.errors.setdefault(seqs[i].seq_id, RequestFailure(NO_ADMISSIBLE_TOKEN, invalid_request=True))
        for seq, token, lp in zip(seqs, out.tokens, out.logprobs):
            if seq.seq_id in result.errors:
                continue
            result.tokens[seq.seq_id] = token
            if lp is not None:
                result.logprobs[seq.seq_id] = lp
        return result

    def _lora_rows(self, order) -> list[int] | None:
        """Each token row's adapter slot (-1: base), or None when no row has one."""
        if self.lora is None or all(seq.lora_slot < 0 for seq, _ in order):
            return None
        return [seq.lora_slot for seq, n in order for _ in range(n)]

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[int], result: StepResult) -> None:
        """Sample a step with proposals: each sequence that verifies k of them gets between 1 and
        k + 1 tokens in ``result.accepted``; the others one token, as :meth:`execute` gives."""
        from tianxia.engine.spec_decode.rejection_sampler import DraftedView, Group, verify

        groups, views = [], []
        starts = set(drafted)
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            if i in starts:
                drafts = seq.spec_token_ids
                groups.append(Group(i, drafts, seq.draft_probs, seq.grammar))
                views.extend(DraftedView(seq, drafts[:j]) for j in range(len(drafts) + 1))
                i += len(drafts) + 1
            else:
                groups.append(Group(i, [], None))
                views.append(seq)
                i += 1
        out = verify(self.sampler, logits, SamplingBatch.from_sequences(views, self.eos_ids), groups)
        for g, tokens, lps, dead in zip(groups, out.tokens, out.logprobs, out.dead):
            seq = seqs[g.start]
            if dead:
                result.errors.setdefault(seq.seq_id, RequestFailure(NO_ADMISSIBLE_TOKEN, invalid_request=True))
            if seq.seq_id in result.errors:
                continue
            if g.start in starts:
                result.accepted[seq.seq_id] = tokens
                if lps is not None:
                    result.accepted_logprobs[seq.seq_id] = lps
            else:
                result.tokens[seq.seq_id] = tokens[0]
                if lps is not None:
                    result.logprobs[seq.seq_id] = lps[0]

    @staticmethod
    def _nan_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """[rows] bool on the logits' device, without a host sync: a row's sum is NaN where one of
        its logits is (or where it holds both infinities): one value per row, where isnan made a
        flag per logit (a third of a millisecond per step for a 150k vocabulary on CPU)."""
        if faults.ACTIVE:
            for i, seq in enumerate(seqs):
                if faults.hits("nan", seq.prompt):
                    logits[i] = float("nan")
        return logits.sum(dim=-1).isnan()

    @staticmethod
    def _drop_nan_rows(logits: torch.Tensor, maybe_nan: torch.Tensor, seqs: list[Sequence],
                       result: StepResult) -> torch.Tensor:
        """A row with NaN would sample garbage: its sequence gets an error instead of a token."""
        if not bool(maybe_nan.any()):
            return logits
        nan_rows = torch.isnan(logits).any(dim=-1)
        if not bool(nan_rows.any()):
            return logits
        for i in nan_rows.nonzero().flatten().tolist():
            result.errors[seqs[i].seq_id] = RequestFailure("the model produced NaN logits for this request")
        return logits.masked_fill(nan_rows[:, None], 0.0)

    # --- decode routes ------------------------------------------------------------------------

    def setup_decode(self, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
                     fused_step: bool = True) -> None:
        """Pick the decode route: the family's fused step if it has one for this device (and
        ``fused_step``), and on CUDA (unless ``enforce_eager``) CUDA graphs of that step or of the
        module forward."""
        from tianxia.layers.rotary import RotaryEmbedding

        if self.device.type != "cpu":
            # rotary tables cover every position up front, so no step reads a position back
            for module in self.model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.ensure_positions(max_model_len)
        self.decode_step = self.model.fast_decode_step(self.kv_caches, max_model_len) if fused_step else None
        if self.device.type != "cuda":
            return
        if enforce_eager:
            logger.info("--enforce-eager: decode steps run without CUDA graphs (%s)",
                        "fused step" if self.decode_step is not None else "module forward")
            return
        from tianxia.engine.cuda_graph import CudaGraphRunner, module_decode_fn
        from tianxia.layers.attention.backend import triton_available

        step = self.decode_step
        reason = None if triton_available() else "a missing Triton install"
        if step is None:
            reason = reason or self.model.cuda_graph_unsafe_reason()
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return
        runner = CudaGraphRunner(
            step if step is not None else module_decode_fn(self.model, self.kv_caches),
            vocab_size=self.config.vocab_size, num_kv_heads=self.config.num_key_value_heads,
            block_size=self.block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            device=self.device, variants=step.variants if step is not None else (),
            set_variant=step.set_variant if step is not None else None,
        )
        runner.capture()
        logger.info("decode steps: CUDA graphs of the %s", "fused step" if step is not None else "module forward")
        self.graph_runner = runner
        if self.sampler.samples_on_device(runner.logits):
            # sampled steps replay the sampler too, reading the decode graphs' logits in place
            graphs = SamplerGraphs(runner.ladder, self.config.vocab_size, self.device, logits=runner.logits)
            try:
                graphs.warm_up(DEFAULT_KINDS)
                self.sampler.graphs = graphs
            except RuntimeError as err:  # sampling stays on eager launches, as without graphs
                logger.warning("sampler CUDA graphs off: %s", err)

    def _decode_logits(self, order, ids, pos, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits of every row from a captured graph or the fused step when the step is all
        decodes and its route takes the batch, else None (the module forward runs)."""
        if meta.num_decodes != len(order):
            return None
        for seq, _ in order:
            if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                return None
        gr = self.graph_runner
        if gr is not None and len(order) <= gr.max_batch:
            self.route_counts["graph"] += 1
            return gr.run(ids, pos, meta)
        step = self.decode_step
        if step is not None and (step.max_batch is None or len(order) <= step.max_batch):
            self.route_counts["fused"] += 1
            return step(ids, pos, meta)
        return None

    def _rows_to_keep(self, order, rows: list[int], tokens: int) -> list[int] | None:
        """The hidden rows a step needs (those it samples from), where the model can drop the
        others before its last MLP: None when it cannot, when every row is needed (decode steps)
        or when a prompt's logprobs need them all."""
        if not getattr(self.model, "keeps_rows", False) or len(set(rows)) == tokens:
            return None
        if any(seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens
               for seq, _ in order):
            return None
        return sorted(set(rows))

    def _prompt_logprobs(self, order, hidden, meta: AttentionMetadata, result: StepResult) -> None:
        for i, (seq, n) in enumerate(order):
            if seq.prompt_logprobs is None or seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue
            start = seq.num_computed_tokens
            # position p predicts token p + 1; report only prompt tokens not reported yet
            # (a preempted sequence recomputes its prompt)
            targets = [
                p + 1 for p in range(start, start + n)
                if len(seq.prompt_logprobs) <= p + 1 < seq.num_prompt_tokens
            ]
            if not targets:
                continue
            base = meta.query_start_loc[i] - start
            idx = torch.tensor([base + t - 1 for t in targets], device=self.device)
            lp = self.model.compute_logits(hidden[idx]).log_softmax(dim=-1)
            k = seq.params.prompt_logprobs
            top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
            actual = torch.tensor([seq.token_ids[t] for t in targets], device=self.device)
            chosen = lp.gather(1, actual[:, None]).squeeze(1)
            ranks = (lp > chosen[:, None]).sum(-1) + 1
            result.prompt_logprobs[seq.seq_id] = [
                (ti[:k], tv[:k], c, r)
                for ti, tv, c, r in zip(top_ids.tolist(), top_vals.tolist(), chosen.tolist(), ranks.tolist())
            ]

    @torch.inference_mode()
    def last_logits(self, scheduled: list) -> tuple[list, torch.Tensor]:
        """Logits at the last new token of each scheduled item, with the items in the order of
        the rows (a draft model's steps; items need what :meth:`_prepare` reads of a sequence)."""
        order, ids, pos, meta = self._prepare(scheduled)
        logits = self._decode_logits(order, ids, pos, meta)
        if logits is not None:
            return order, logits
        rows = [meta.query_start_loc[i + 1] - 1 for i in range(len(order))]
        keep = self._rows_to_keep(order, rows, ids.shape[0])
        if keep is not None:
            hidden = self.model(ids, pos, self.kv_caches, meta, torch.tensor(keep, device=self.device))
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta)[torch.tensor(rows, device=self.device)]
        self.route_counts["eager"] += 1
        return order, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def prompt_hidden_states(self, seq: Sequence, chunk: int) -> torch.Tensor:
        """The model's final hidden states (after its last norm) at every position of an
        already-allocated sequence, computed in chunks: what embeddings pool."""
        rows = []
        while seq.num_computed_tokens < len(seq):
            n = min(chunk, len(seq) - seq.num_computed_tokens)
            _, ids, pos, meta = self._prepare([(seq, n)])
            # a copy: a one-token chunk takes the fused decode step, whose buffers are reused
            rows.append(self.model(ids, pos, self.kv_caches, meta).clone())
            seq.num_computed_tokens += n
        return torch.cat(rows)

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence, chunk: int) -> torch.Tensor:
        """Logits at every position of an already-allocated sequence, computed in chunks."""
        return self.model.compute_logits(self.prompt_hidden_states(seq, chunk)).cpu()
