"""Runs a step's :class:`~tianxia.engine.step_io.StepInput` as one flat forward pass, then samples.

The batch is the concatenation of every scheduled sequence's new tokens (no padding), with their
positions, the cache slot each new token's K/V goes to, and each sequence's block table. The
runner reads plain data only (no ``Sequence``) and returns a ``RunnerOutput``; what the tokens do
to the sequences is the scheduler's ``update``.

This is the one place that picks how a step runs (the *route*, counted in ``route_counts``):

- ``graph``: a step of decodes, replayed from a CUDA graph of the family's fused decode step or,
  for a family without one, of its module forward (:mod:`tianxia.engine.cuda_graph`); a step
  with prompt chunks or verifications takes it as one-token rows where the graphs hold its rows;
- ``fused``: the family's fused step called directly: a step of decodes (the CPU's one-call C++
  decoder; a GPU with graphs off) and, on a GPU, a step with prompt chunks that the graphs do not
  hold (logits of its sampled rows only);
- ``eager``: the module forward (prompt chunks on a CPU, steps with more rows than a route takes,
  prompt logprobs, adapters).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from itertools import groupby

import torch

from tianxia.config import CacheConfig, ModelConfig
from tianxia.engine.step_io import (NAN_LOGITS, NO_ADMISSIBLE_TOKEN, DeviceTokens, RequestFailure, RunnerOutput,
                                    StepInput, TokenRun, prepare_batch)
from tianxia.layers.attention import AttentionMetadata
from tianxia.layers.attention.backend import attention_modules
from tianxia.layers.lora import LoRAState
from tianxia.layers.sampler import Sampler, host_ints, to_device
from tianxia.layers.sampler_graphs import DEFAULT_KINDS, SamplerGraphs
from tianxia.loader.layer_split import layer_split_of
from tianxia.quant.kv_blocks import kv_row_bytes

logger = logging.getLogger(__name__)

# above the decode batch sizes (cuda_graph.mixed_step_rows), the most context positions a mixed
# step's prompt rows may read as one-token rows in a decode graph, all of them together: each row
# reads its whole context, where the prefill kernel reads it once per tile of 64 rows (a few
# short prompts beside the decodes, not a long chunk)
_MIXED_ROWS_CONTEXT = 1 << 17


def _prompt_rows_context(step: StepInput) -> int:
    """The context positions the prompt rows of ``step`` read, summed over the rows."""
    total = 0
    for q, n in zip(step.query_lens[step.num_decodes:], step.seq_lens[step.num_decodes:]):
        total += q * n - q * (q - 1) // 2
    return total


_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float8_e4m3fn: 1}


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype | str) -> int:
    """K and V bytes of one token over all layers; ``dtype`` a torch dtype or a block format name."""
    row = kv_row_bytes(dtype, config.head_dim) if isinstance(dtype, str) else config.head_dim * _DTYPE_BYTES[dtype]
    return 2 * config.num_hidden_layers * config.num_key_value_heads * row


class ModelRunner:
    # whether verification steps may run as one-token rows through the decode graphs (a
    # tensor-parallel rank 0 may not: its workers build their batches from the step it sends)
    verifies_as_decodes = True

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
        # each layer's cache lives where the layer runs: one part per device (layer_split: -ngl)
        split = layer_split_of(model)
        places = split.layer_devices() if split is not None else [(device, kv_dtype)] * model_config.num_hidden_layers
        self.kv_parts = []
        for (where, compute_dtype), layers in groupby(places):  # consecutive layers on one device
            # the CPU layers of a split model keep a float32 cache, as the CPU engine does
            part_dtype = kv_dtype if where.type == device.type else compute_dtype
            self.kv_parts.append(self._allocate_kv(model_config, len(list(layers)), part_dtype, where))
        self.kv_caches = [layer for part in self.kv_parts for layer in part.unbind(0)]
        # the whole cache as one tensor where it is one (fp8 calibration reads it)
        self.kv_cache = self.kv_parts[0] if len(self.kv_parts) == 1 else None
        # an fp8 cache's per-layer K and V scales (vLLM's k_scale / v_scale), 1.0 until calibrated;
        # the kernels read them from here, so changing them in place keeps captured graphs valid
        self.kv_scales = None
        if kv_dtype == torch.float8_e4m3fn:
            self.kv_scales = torch.ones(model_config.num_hidden_layers, 2, dtype=torch.float32, device=device)
        for i, module in enumerate(attention_modules(model)):
            module.kv_scale = None if self.kv_scales is None else self.kv_scales[i]
        self.sampler = Sampler(seed)
        self.graph_runner = None  # CUDA: decode steps through captured graphs (setup_decode)
        self.decode_step = None  # the family's fused decode step (setup_decode), or None
        self.route_counts: Counter[str] = Counter()  # steps per route: graph, fused, eager
        self.lora: LoRAState | None = None  # the adapters' grouped product (--enable-lora)
        self.fused_lora = False  # whether the fused decode step adds the adapters' deltas itself
        # the last step's sampled ids (on the device where it sampled there): the input tokens of
        # a step prepared before they were read (StepInput.prev_rows)
        self._prev_tokens: torch.Tensor | None = None

    def _allocate_kv(self, config: ModelConfig, num_layers: int, kv_dtype: torch.dtype | str,
                     device: torch.device) -> torch.Tensor:
        # a block format (q8_0, q4_0) keeps each head's row as uint8 blocks (quant/kv_blocks.py)
        blocks = isinstance(kv_dtype, str)
        shape = (num_layers, 2, self.num_blocks, self.block_size, config.num_key_value_heads,
                 kv_row_bytes(kv_dtype, config.head_dim) if blocks else config.head_dim)
        return torch.zeros(shape, dtype=torch.uint8 if blocks else kv_dtype, device=device)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.kv_parts)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (``(src, dst)`` pairs: copy-on-write of a shared last block)."""
        for src, dst in copies:
            for part in self.kv_parts:
                part[:, :, dst].copy_(part[:, :, src])

    def tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids, positions and attention metadata on the device."""
        T, S = len(step.input_ids), step.num_seqs
        max_blocks = max(len(t) for t in step.block_tables)
        # one host tensor (ids, positions, slots, lengths, query starts, zero-padded block tables) and one copy
        # to the device, instead of a tensor and a transfer each. Each part starts at an even
        # element (16 bytes): Triton specializes a kernel on its pointers' 16-byte alignment, so
        # parts at odd offsets would compile a second variant of every kernel mid-serving
        t_pad, s_pad = [0] * (T % 2), [0] * (S % 2)
        prev = [] if step.prev_rows is None else step.prev_rows + t_pad
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        flat = (step.input_ids + t_pad + step.positions + t_pad + step.slot_mapping + t_pad
                + step.seq_lens + s_pad + prev + starts + [0] * ((S + 1) % 2))  # ... query_start_loc
        for table in step.block_tables:
            flat += table
            flat += [0] * (max_blocks - len(table))
        # pinned and not waited for: the previous step may still be running
        buf = to_device(host_ints(flat), self.device)
        T2, S2 = T + len(t_pad), S + len(s_pad)
        ids = buf[:T]
        if step.prev_rows is not None:
            last = self._prev_tokens
            if last.device != buf.device:
                last = to_device(last, buf.device)
            rows = buf[3 * T2 + S2 : 3 * T2 + S2 + T]
            # -1: a row with its own token (a prompt chunk's)
            ids = last[rows] if min(step.prev_rows) >= 0 else torch.where(rows >= 0, last[rows.clamp(min=0)], ids)
        at = 3 * T2 + S2 + len(prev)  # query_start_loc, then the block tables
        tables_at = at + S + 1 + (S + 1) % 2
        meta = AttentionMetadata(
            slot_mapping=buf[2 * T2 : 2 * T2 + T],
            block_tables=buf[tables_at:].view(S, max_blocks),
            seq_lens=step.seq_lens,
            query_lens=step.query_lens,
            query_start_loc=starts,
            num_decodes=step.num_decodes,
            seq_lens_tensor=buf[3 * T2 : 3 * T2 + S],
            block_size=self.block_size,
            query_start_tensor=buf[at : at + S + 1],
        )
        return ids, buf[T2 : T2 + T], meta

    @torch.inference_mode()
    def execute(self, step: StepInput) -> RunnerOutput:
        """Run one step and sample its sampled rows (``step.sample_rows``). On a GPU a step whose
        rows ask for no logprobs returns without waiting for its kernels: its ids reach the host
        when ``RunnerOutput.tokens`` reads them."""
        self.copy_blocks(step.copies)
        # a step that verifies proposals runs as the decode graphs' one-token rows where it can
        flat = self._as_decodes(step, verification=True)
        if flat is None and self.graph_runner is not None:
            # a step with prompt rows replays the decode graphs too where they take its rows: the
            # module forward's hundreds of launches cost a served step more than its rows do (on
            # a CPU the fused step has no launches to save, and its prompt rows ran 10% slower)
            flat = self._as_decodes(step, verification=False)
        ids, pos, meta = self.tensors(flat or step)
        rows = list(step.sample_rows)
        row_slots = self.lora_rows(step)
        keep = self._rows_to_keep(step, rows, ids.shape[0])
        # a device state's graphs read every step's rows (base rows too: -1)
        on_device = self.lora is not None and self.lora.on_device
        if row_slots or on_device:
            self.lora.begin_step(row_slots, keep)
        try:
            # rows with an adapter take the module forward, whose hooks add the adapters'
            # deltas, unless the fused decode step or the decode graphs take them
            graph_logits = (self._decode_logits(flat or step, ids, pos, meta)
                            if not row_slots or self.fused_lora or on_device else None)
            row_logits = None if graph_logits is not None or not rows else self._mixed_logits(step, ids, pos, meta, rows)
            if graph_logits is not None or row_logits is not None:
                hidden = None
            elif keep is not None:
                hidden = self.model(ids, pos, self.kv_caches, meta, to_device(host_ints(keep), self.device))
                where = {r: j for j, r in enumerate(keep)}
                rows = [where[r] for r in rows]
            else:
                hidden = self.model(ids, pos, self.kv_caches, meta)
        finally:
            if row_slots or on_device:
                self.lora.end_step()
        if hidden is not None:
            self.route_counts["eager"] += 1
        result = RunnerOutput(step.sample_seq_ids)
        if keep is None:
            self._prompt_logprobs(step, hidden, meta, result)
        if not rows:
            return result
        if row_logits is not None:
            logits = row_logits
        elif graph_logits is not None:
            same = len(rows) == graph_logits.shape[0] and rows == list(range(len(rows)))
            logits = graph_logits if same else graph_logits[to_device(host_ints(rows), self.device)]
        else:
            logits = self.model.compute_logits(hidden[to_device(host_ints(rows), self.device)])
        nan_rows = self._nan_rows(logits, step.fault_nan_rows)
        drafted = step.spec_groups is not None
        # on the GPU the NaN rows are looked for after sampling: no host sync between the forward
        # and the sampler, whose kernels the host launches meanwhile
        deferred = not drafted and self.sampler.samples_on_device(logits)
        if not deferred:
            logits = self._drop_nan_rows(logits, nan_rows, step.sample_seq_ids, result)
        if drafted:
            self._verify(logits, step, result)
            return result
        if deferred and all(k is None for k in step.sampling.num_logprobs):
            tokens, dead = self.sampler.sample_on_device(logits, step.sampling)
            result.sampled_token_ids = self._prev_tokens = tokens
            result.pending = DeviceTokens(tokens, nan_rows, dead)
            return result
        out = self.sampler(logits, step.sampling)
        if deferred:
            self._drop_nan_rows(logits, nan_rows, step.sample_seq_ids, result)
        for i in out.dead_rows:
            result.errors.setdefault(step.sample_seq_ids[i],
                                     RequestFailure(NO_ADMISSIBLE_TOKEN, invalid_request=True))
        result.sampled_token_ids = self._prev_tokens = torch.tensor(out.tokens, dtype=torch.int64)
        for sid, lp in zip(step.sample_seq_ids, out.logprobs):
            if lp is not None and sid not in result.errors:
                result.logprobs[sid] = lp
        return result

    def _as_decodes(self, step: StepInput, verification: bool) -> StepInput | None:
        """The step's rows as one-token rows, each its own sequence over its sequence's blocks
        with the context up to its position, or None where that does not apply: with
        ``verification``, a step of decodes and verifications (k + 1 rows of a sequence, each
        sampled); without, any step whose rows fit (a draft model's catch-up chunks; on a GPU,
        every step with prompt rows).

        Each layer writes every row's K/V before any row attends, so row j of a chunk sees the
        rows before it as a decode sees its context: the decode CUDA graphs (on a CPU, the fused
        C++ step) then run it as they run decoding, instead of the module forward of the whole
        model (on a GPU several replayed decode steps' time, on a CPU four plain steps' for 9
        rows). On a CPU the numbers are the module forward's (its kernels do not depend on the
        batch or the chunk). On a GPU they are a decode step's: outside ``--batch-invariant``
        (which runs no graphs) a row's numbers already depend on the batch it runs in."""
        if (step.all_rows or step.prompt_logprobs or step.num_decodes == step.num_seqs
                or any(slot >= 0 for slot in step.lora_slots)):
            return None
        num_rows = len(step.input_ids)
        if verification and (not self.verifies_as_decodes or step.spec_groups is None
                             or len(set(step.sample_rows)) != num_rows):
            return None
        gr = self.graph_runner
        if gr is not None:
            if num_rows > gr.max_batch:
                return None
            if num_rows > gr.max_num_seqs and _prompt_rows_context(step) > _MIXED_ROWS_CONTEXT:
                return None
        elif self.device.type != "cpu" or self.decode_step is None:
            return None
        elif self.decode_step.max_batch is not None and num_rows > self.decode_step.max_batch:
            return None
        tables: list[list[int]] = []
        seq_ids: list[int] = []
        for sid, n, table in zip(step.seq_ids, step.query_lens, step.block_tables):
            tables += [table] * n
            seq_ids += [sid] * n
        return replace(step, seq_ids=seq_ids, query_lens=[1] * num_rows, block_tables=tables,
                       seq_lens=[p + 1 for p in step.positions], lora_slots=[-1] * num_rows)

    def lora_rows(self, step: StepInput) -> list[int] | None:
        """Each token row's adapter slot (-1: base), or None when no row has one."""
        if self.lora is None or all(slot < 0 for slot in step.lora_slots):
            return None
        return [slot for slot, n in zip(step.lora_slots, step.query_lens) for _ in range(n)]

    def _verify(self, logits: torch.Tensor, step: StepInput, result: RunnerOutput) -> None:
        """Sample a step with proposals: each sequence that verifies k of them gets between 1 and
        k + 1 tokens in ``result.accepted``; the others one token, as :meth:`execute` gives."""
        from tianxia.engine.spec_decode.rejection_sampler import verify

        groups = step.spec_groups
        out = verify(self.sampler, logits, step.sampling, groups)
        tokens = [-1] * len(step.sample_seq_ids)
        for g, toks, lps, dead in zip(groups, out.tokens, out.logprobs, out.dead):
            sid = step.sample_seq_ids[g.start]
            if dead:
                result.errors.setdefault(sid, RequestFailure(NO_ADMISSIBLE_TOKEN, invalid_request=True))
            if sid in result.errors:
                continue
            if g.drafts:
                result.accepted[sid] = toks
                if lps is not None:
                    result.accepted_logprobs[sid] = lps
            else:
                tokens[g.start] = toks[0]
                if lps is not None:
                    result.logprobs[sid] = lps[0]
        result.sampled_token_ids = torch.tensor(tokens, dtype=torch.int64)

    @staticmethod
    def _nan_rows(logits: torch.Tensor, fault_rows: list[int]) -> torch.Tensor:
        """[rows] bool on the logits' device, without a host sync: a row's sum is NaN where one of
        its logits is (or where it holds both infinities): one value per row, where isnan made a
        flag per logit (a third of a millisecond per step for a 150k vocabulary on CPU)."""
        for i in fault_rows:
            logits[i] = float("nan")
        return logits.sum(dim=-1).isnan()

    @staticmethod
    def _drop_nan_rows(logits: torch.Tensor, maybe_nan: torch.Tensor, seq_ids: list[int],
                       result: RunnerOutput) -> torch.Tensor:
        """A row with NaN would sample garbage: its sequence gets an error instead of a token."""
        if not bool(maybe_nan.any()):
            return logits
        nan_rows = torch.isnan(logits).any(dim=-1)
        if not bool(nan_rows.any()):
            return logits
        for i in nan_rows.nonzero().flatten().tolist():
            result.errors[seq_ids[i]] = RequestFailure(NAN_LOGITS)
        return logits.masked_fill(nan_rows[:, None], 0.0)

    # --- decode routes ------------------------------------------------------------------------

    def setup_decode(self, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
                     fused_step: bool = True, max_rows: int | None = None) -> None:
        """Pick the decode route: the family's fused step if it has one for this device (and
        ``fused_step``), and on CUDA (unless ``enforce_eager``) CUDA graphs of that step or of the
        module forward, for up to ``max_rows`` one-token rows (mixed steps; default
        ``max_num_seqs``)."""
        from tianxia.layers.rotary import RotaryEmbedding

        if self.device.type != "cpu":
            # rotary tables cover every position up front, so no step reads a position back
            for module in self.model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.ensure_positions(max_model_len)
        split = layer_split_of(self.model)
        # a split model's steps hold CPU work: neither the fused step (one device's weights) nor a
        # CUDA graph takes them
        fused_step = fused_step and split is None
        self.decode_step = self.model.fast_decode_step(self.kv_caches, max_model_len) if fused_step else None
        if self.lora is not None and self.decode_step is not None:
            # a fused step that takes rows with adapters keeps their steps (before any capture:
            # on a GPU it may change how it runs its projections)
            attach = getattr(self.decode_step, "attach_lora", None)
            self.fused_lora = attach is not None and attach(self.lora)
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
            reason = reason or ("-ngl: decoder layers run on the CPU" if split is not None else None) \
                or self.model.cuda_graph_unsafe_reason()
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return
        runner = CudaGraphRunner(
            step if step is not None else module_decode_fn(self.model, self.kv_caches),
            vocab_size=self.config.vocab_size, num_kv_heads=self.config.num_key_value_heads,
            block_size=self.block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            device=self.device, variants=step.variants if step is not None else (),
            set_variant=step.set_variant if step is not None else None, max_rows=max_rows,
        )
        runner.capture()
        logger.info("decode steps: CUDA graphs of the %s", "fused step" if step is not None else "module forward")
        self.graph_runner = runner
        if self.sampler.samples_on_device(runner.logits):
            # sampled steps replay the sampler too, reading the decode graphs' logits in place
            # (only decode batches' sizes: a mixed step samples no more rows than it has sequences)
            graphs = SamplerGraphs([p for p in runner.ladder if p <= max_num_seqs], self.config.vocab_size,
                                   self.device, logits=runner.logits)
            try:
                graphs.warm_up(DEFAULT_KINDS)
                self.sampler.graphs = graphs
            except RuntimeError as err:  # sampling stays on eager launches, as without graphs
                logger.warning("sampler CUDA graphs off: %s", err)

    def _decode_logits(self, step: StepInput, ids, pos, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits of every row from a captured graph or the fused step when the step is all
        decodes and its route takes the batch, else None (the module forward runs)."""
        if meta.num_decodes != step.num_seqs or step.all_rows:
            return None
        gr = self.graph_runner
        if gr is not None and step.num_seqs <= gr.max_batch:
            self.route_counts["graph"] += 1
            return gr.run(ids, pos, meta)
        step_fn = self.decode_step
        if step_fn is not None and (step_fn.max_batch is None or step.num_seqs <= step_fn.max_batch):
            self.route_counts["fused"] += 1
            return step_fn(ids, pos, meta)
        return None

    def _mixed_logits(self, step: StepInput, ids, pos, meta: AttentionMetadata, rows: list[int]) -> torch.Tensor | None:
        """Logits of ``rows`` of a step with prompt rows from the fused step, where it takes them
        (on a GPU: a third of the module forward's launches, which set a mixed step's time), else
        None. Not with adapters (their hooks follow the module forward's rows) or where every
        row's hidden state is needed (prompt logprobs, embeddings)."""
        step_fn = self.decode_step
        if (step_fn is None or not getattr(step_fn, "takes_prompt_rows", False) or self.lora is not None
                or step.all_rows or step.prompt_logprobs):
            return None
        self.route_counts["fused"] += 1
        return step_fn(ids, pos, meta, rows=to_device(host_ints(rows), self.device))

    def _rows_to_keep(self, step: StepInput, rows: list[int], tokens: int) -> list[int] | None:
        """The hidden rows a step needs (those it samples from), where the model can drop the
        others before its last MLP: None when it cannot, when every row is needed (decode steps)
        or when a prompt's logprobs need them all."""
        if not getattr(self.model, "keeps_rows", False) or len(set(rows)) == tokens or step.all_rows:
            return None
        return sorted(set(rows))

    def _prompt_logprobs(self, step: StepInput, hidden, meta: AttentionMetadata, result: RunnerOutput) -> None:
        for req in step.prompt_logprobs:
            base = meta.query_start_loc[req.index] - req.start
            idx = torch.tensor([base + t - 1 for t in req.targets], device=self.device)
            lp = self.model.compute_logits(hidden[idx]).log_softmax(dim=-1)
            k = req.k
            top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
            actual = torch.tensor(req.target_ids, device=self.device)
            chosen = lp.gather(1, actual[:, None]).squeeze(1)
            ranks = (lp > chosen[:, None]).sum(-1) + 1
            result.prompt_logprobs[req.seq_id] = [
                (ti[:k], tv[:k], c, r)
                for ti, tv, c, r in zip(top_ids.tolist(), top_vals.tolist(), chosen.tolist(), ranks.tolist())
            ]

    @torch.inference_mode()
    def last_logits(self, step: StepInput) -> torch.Tensor:
        """Logits at the last new token of each sequence of ``step``, in its order (a draft
        model's steps, which sample on their own)."""
        flat = self._as_decodes(step, verification=False)
        if flat is not None:
            logits = self._decode_logits(flat, *self.tensors(flat))
            if logits is not None:
                last = torch.tensor(step.query_lens, device=logits.device).cumsum(0) - 1
                return logits[last]
        ids, pos, meta = self.tensors(step)
        logits = self._decode_logits(step, ids, pos, meta)
        if logits is not None:
            return logits
        rows = [meta.query_start_loc[i + 1] - 1 for i in range(step.num_seqs)]
        keep = self._rows_to_keep(step, rows, ids.shape[0])
        if keep is not None:
            hidden = self.model(ids, pos, self.kv_caches, meta, torch.tensor(keep, device=self.device))
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta)[torch.tensor(rows, device=self.device)]
        self.route_counts["eager"] += 1
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def prompt_hidden_states(self, token_ids: list[int], block_table: list[int], chunk: int) -> torch.Tensor:
        """The model's final hidden states (after its last norm) at every position of
        ``token_ids``, whose blocks are allocated, computed in chunks: what embeddings pool."""
        run = TokenRun(token_ids, 0, block_table)
        rows = []
        while run.num_computed_tokens < len(run):
            n = min(chunk, len(run) - run.num_computed_tokens)
            ids, pos, meta = self.tensors(prepare_batch([(run, n)], self.block_size)[1])
            # a copy: a one-token chunk takes the fused decode step, whose buffers are reused
            rows.append(self.model(ids, pos, self.kv_caches, meta).clone())
            run.num_computed_tokens += n
        return torch.cat(rows)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], block_table: list[int], chunk: int) -> torch.Tensor:
        """Logits at every position of ``token_ids``, whose blocks are allocated, in chunks."""
        return self.model.compute_logits(self.prompt_hidden_states(token_ids, block_table, chunk)).cpu()
