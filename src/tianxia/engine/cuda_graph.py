"""CUDA graphs for decode steps, over whatever the model offers for them.

A decode step (one new token per sequence) launches hundreds of small kernels; on a GPU their
launch gaps, not the arithmetic, set its time at small batches. At start-up
:class:`CudaGraphRunner` captures one CUDA graph per batch size of a ladder (1, 2, 4, 8, then
steps of 16 up to ``max_num_seqs``) over static input buffers; a step pads its batch to the next
size (padding rows: slot -1, so nothing is written to the cache, and length 0, so attention
returns zeros), copies its inputs in and replays the graph. ``--enforce-eager`` turns it off.

What is captured is a *decode function*: token ids, positions and a static
:class:`AttentionMetadata` in, float32 logits out. It is the family's fused step where the model
offers one (:meth:`~tianxia.models.base.CausalLM.fast_decode_step`, e.g.
:mod:`tianxia.models.llama_gpu_step`), otherwise the model's own forward followed by
``compute_logits``, as nano-vllm captures its model: every family decodes from graphs. The
metadata's ``num_splits`` is fixed per batch size, from ``max_model_len``, so a graph's attention
grid holds for any context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tianxia.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DecodeFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

# only this thread's calls may break a capture: under tensor parallelism NCCL's watchdog thread
# polls the events of earlier collectives while a graph of the step's all-reduces is captured
_CAPTURE_MODE = "thread_local"


def batch_ladder(max_num_seqs: int, max_rows: int | None = None) -> list[int]:
    """1, 2, 4, 8, steps of 16 up to ``max_num_seqs``, then steps of 64 up to ``max_rows``: the
    sizes above a decode batch are mixed steps run as one-token rows (prompt chunks beside
    decodes), whose module forward or uncaptured fused step the host's launches would bound."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    if max_rows is not None and max_rows > max_num_seqs:
        sizes += list(range(max_num_seqs + 64, max_rows, 64))
        sizes.append(max_rows)
    return sorted(set(sizes))


def mixed_step_rows(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most rows the decode graphs take: a full decode batch plus a few prompts' worth (four
    times the batch, at most 1024 rows, within the step's token budget). Their logits buffer,
    ``rows x vocab`` float32, is what the extra sizes cost in memory."""
    return max(max_num_seqs, min(max_num_batched_tokens, 4 * max_num_seqs, 1024))


def module_decode_fn(model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> DecodeFn:
    """The model's own forward and logits as a decode function."""

    def decode(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model(ids, positions, kv_caches, meta)).float()

    return decode


class CudaGraphRunner:
    """Static buffers, one captured graph per ladder size, and the replay of a decode step.

    ``decode`` is the function captured; ``variants`` (with ``set_variant``) are batch-1 forms of
    it to time at capture, keeping the fastest (the fused step's Triton-GEMV and cuBLAS forms).
    """

    def __init__(self, decode: DecodeFn, *, vocab_size: int, num_kv_heads: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device,
                 variants: tuple[str, ...] = (), set_variant: Callable[[str], None] | None = None,
                 use_graphs: bool = True, max_rows: int | None = None) -> None:
        from tianxia.layers.attention.triton_attention import decode_num_splits

        self.decode = decode
        self.variants = variants
        self.set_variant = set_variant
        self.device = device
        self.block_size = block_size
        self.ladder = batch_ladder(max_num_seqs, max_rows)
        self.max_batch = self.ladder[-1]  # rows, prompt rows included
        self.max_num_seqs = max_num_seqs  # the largest decode batch
        P = self.max_batch
        max_blocks = (max_model_len + block_size - 1) // block_size + 1
        self.ids = torch.zeros(P, dtype=torch.int64, device=device)
        self.pos = torch.zeros(P, dtype=torch.int64, device=device)
        self.slots = torch.full((P,), -1, dtype=torch.int64, device=device)
        self.lens = torch.zeros(P, dtype=torch.int64, device=device)
        self.tables = torch.zeros(P, max_blocks, dtype=torch.int64, device=device)
        self.logits = torch.zeros(P, vocab_size, dtype=torch.float32, device=device)
        self.splits = {p: decode_num_splits(p, num_kv_heads, max_model_len) for p in self.ladder}
        self.use_graphs = use_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.batch1_variants_ms: dict[str, float] | None = None

    def _meta(self, p: int) -> AttentionMetadata:
        """Metadata over the static buffers for a batch of ``p`` decodes (the host-side lists
        hold no lengths: nothing in a captured step may read them)."""
        return AttentionMetadata(
            slot_mapping=self.slots[:p], block_tables=self.tables[:p], seq_lens=[0] * p,
            query_lens=[1] * p, query_start_loc=list(range(p + 1)), num_decodes=p,
            seq_lens_tensor=self.lens[:p], block_size=self.block_size, num_splits=self.splits[p],
        )

    def _forward(self, p: int) -> None:
        self.logits[:p].copy_(self.decode(self.ids[:p], self.pos[:p], self._meta(p)))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles and autotunes the kernels) and capture every ladder size, largest
        first, all graphs sharing one memory pool."""
        t0 = time.perf_counter()
        self.slots.fill_(-1)
        self.lens.zero_()
        for p in sorted(self.ladder, reverse=True):
            self._forward(p)  # eager: compile, autotune, cuBLAS handles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.use_graphs and self.device.type == "cuda":
            pool = None
            for p in sorted(self.ladder, reverse=True):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, capture_error_mode=_CAPTURE_MODE):
                    self._forward(p)
                if pool is None:
                    pool = g.pool()
                self.graphs[p] = g
            if 1 in self.graphs and len(self.variants) > 1:
                self._pick_batch1(pool)
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("decode %s for batch sizes %s in %.1fs",
                    "CUDA graphs captured" if self.use_graphs else "kernels warmed up",
                    self.ladder, self.capture_seconds)

    def _time(self, graph: torch.cuda.CUDAGraph) -> float:
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 20

    def _pick_batch1(self, pool) -> None:
        """Batch 1: capture each variant (the first is already captured) and keep the fastest
        (the Triton GEMV wins on large weights, cuBLAS's fewer-but-heavier kernels can on small
        models)."""
        first, *others = self.variants
        graphs = {first: self.graphs[1]}
        try:
            for name in others:
                self.set_variant(name)
                g = torch.cuda.CUDAGraph()
                self._forward(1)
                with torch.cuda.graph(g, pool=pool, capture_error_mode=_CAPTURE_MODE):
                    self._forward(1)
                graphs[name] = g
        finally:
            self.set_variant(first)
        # the first is timed twice, before and after the others, so a clock ramp does not favour it
        times = {name: self._time(g) for name, g in graphs.items()}
        times[first] = min(times[first], self._time(graphs[first]))
        best = min(times, key=times.get)
        self.batch1_variants_ms = times
        self.graphs[1] = graphs[best]
        self.set_variant(best)
        logger.info("batch-1 decode graph: %s: using %s",
                    ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()), best)

    def padded_size(self, batch: int) -> int:
        return next(p for p in self.ladder if p >= batch)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a pure-decode batch (B <= max_batch)."""
        B = ids.shape[0]
        p = self.padded_size(B)
        self.ids[:B].copy_(ids, non_blocking=True)
        self.pos[:B].copy_(pos, non_blocking=True)
        self.slots[:B].copy_(meta.slot_mapping, non_blocking=True)
        self.lens[:B].copy_(meta.seq_lens_tensor, non_blocking=True)
        if p > B:
            self.slots[B:p].fill_(-1)
            self.lens[B:p].zero_()
        w = meta.block_tables.shape[1]
        self.tables[:B, :w].copy_(meta.block_tables, non_blocking=True)
        if p in self.graphs:
            self.graphs[p].replay()
        else:
            self._forward(p)
        return self.logits[:B]
