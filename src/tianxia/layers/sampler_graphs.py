"""The device sampler's kernels replayed from CUDA graphs, one per batch size and kind of batch.

A sampled decode step on a GPU launches about ten kernels after the forward (temperature, min-p,
the top-k/top-p threshold search of ``triton_sampling``, the Gumbel-max draw, the greedy rows'
argmax); from Python each launch costs the host 20-70 us, which at a small model's step is a
tenth of it. :class:`SamplerGraphs` captures that sequence over static buffers: the host copies
each row's numbers (temperature, top-k, top-p, min-p) and noise key in, as two small copies, and
replays one graph. What a graph computes is what the eager device path computes from the same
keys, kernel for kernel, so a request's tokens do not depend on which one ran.

A graph is keyed by its padded batch size and the batch's *kind*: which truncations any row asks
for, and the width of the ``topk`` that reads a top-k off directly (rounded up to a power of two,
so a handful of widths cover every request). Graphs are captured on first use, after an eager run
of the same kind at the largest size has compiled its kernels; :meth:`warm_up` does that at start
for the kinds clients send by default, so no kernel compiles while serving.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


class BatchKind(NamedTuple):
    """What a sampled batch needs of the device sampler."""

    k_width: int  # 0: no row has a top-k; > 0: read off ``topk`` this wide; -1: searched for
    top_p: bool
    min_p: bool


def batch_kind(top_k: torch.Tensor, any_top_k: bool, any_top_p: bool, any_min_p: bool,
               vocab: int) -> BatchKind:
    """The kind of a batch from its (host) top-k column, greedy rows already zeroed."""
    from tianxia.layers.triton_sampling import TOPK_DIRECT

    width = 0
    if any_top_k:
        k_max = min(int(top_k.max()), vocab)
        width = -1 if k_max > TOPK_DIRECT else min(max(16, 1 << (k_max - 1).bit_length()), TOPK_DIRECT, vocab)
    return BatchKind(width, any_top_p, any_min_p)


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop (in place) the logits whose probability is below ``min_p`` times their row's largest:
    p < min_p * p_max where logit < max logit + log(min_p), no softmax needed (log 0 = -inf)."""
    floor = scaled.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    scaled.masked_fill_(scaled < floor, float("-inf"))


def draw(logits: torch.Tensor, numbers: torch.Tensor, keys: torch.Tensor, kind: BatchKind) -> torch.Tensor:
    """[S] int64 tokens from [S, V] processed logits (scaled in place), ``numbers`` [4, S] float32
    (temperature, 0 for greedy rows; top-k, 0 for none; top-p; min-p; each row contiguous, as
    the kernels read them) and ``keys`` [S, 2] int64
    (each row's noise key halves): greedy rows take their argmax, the others a draw from their
    truncated softmax. No host sync: it is captured as is."""
    from tianxia.layers import triton_sampling

    temp = numbers[0]
    greedy = temp == 0
    greedy_tokens = logits.argmax(dim=-1)
    scaled = logits.div_(torch.where(greedy, 1.0, temp)[:, None])
    if kind.min_p:
        apply_min_p(scaled, numbers[3])
    thresholds = None
    if kind.k_width or kind.top_p:
        thresholds = triton_sampling.truncation_thresholds(
            scaled, numbers[1].long(), numbers[2], use_k=kind.k_width != 0, use_p=kind.top_p,
            k_max=kind.k_width if kind.k_width > 0 else None)
    tokens = triton_sampling.gumbel_argmax(scaled, keys, thresholds)
    return torch.where(greedy, greedy_tokens, tokens)


class SamplerGraphs:
    """Static buffers, and the graphs over them of :func:`draw` for each (padded size, kind).

    ``logits`` may be given as the decode graphs' output buffer: logits that are already there
    (a pure-decode step) are sampled without a copy."""

    def __init__(self, ladder: list[int], vocab: int, device: torch.device,
                 logits: torch.Tensor | None = None, use_graphs: bool = True) -> None:
        self.ladder = sorted(ladder)
        self.max_batch = self.ladder[-1]
        self.vocab = vocab
        self.device = device
        P = self.max_batch
        self.logits = logits if logits is not None else torch.zeros(P, vocab, dtype=torch.float32, device=device)
        self.numbers = torch.zeros(4, P, dtype=torch.float32, device=device)
        self.keys = torch.zeros(P, 2, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(P, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        # two sets of host staging buffers, taken in turn: a step launched before the previous
        # one ran must not overwrite what that step's copy has yet to read (each set's event
        # marks its copy done)
        self._staging = [(torch.zeros(4, P, dtype=torch.float32, pin_memory=pin),
                          torch.zeros(P, 2, dtype=torch.int64, pin_memory=pin),
                          torch.cuda.Event() if pin else None) for _ in range(2)]
        self._turn = 0
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[tuple[int, BatchKind], torch.cuda.CUDAGraph] = {}
        self.compiled: set[BatchKind] = set()
        self._pool = None

    def fits(self, logits: torch.Tensor) -> bool:
        return logits.shape[0] <= self.max_batch and logits.shape[1] == self.vocab and logits.dtype == torch.float32

    def sample(self, logits: torch.Tensor, numbers: torch.Tensor, keys: torch.Tensor,
               kind: BatchKind) -> torch.Tensor:
        """[B] int64 tokens on the device, as :func:`draw` gives for these rows (``numbers``
        [4, B], ``keys`` [B, 2], on the host)."""
        B = logits.shape[0]
        p = next(s for s in self.ladder if s >= B)
        if logits.data_ptr() != self.logits.data_ptr() or logits.stride() != self.logits.stride():
            self.logits[:B].copy_(logits)
        numbers_host, keys_host, copied = self._staging[self._turn]
        self._turn ^= 1
        if copied is not None:
            copied.synchronize()
        # padding rows are greedy: nothing to search for, and their token is never read
        numbers_host[:, :B] = numbers
        numbers_host[:, B:p] = 0.0
        keys_host[:B] = keys
        self.numbers.copy_(numbers_host, non_blocking=True)
        self.keys[:p].copy_(keys_host[:p], non_blocking=True)
        if copied is not None:
            copied.record()
        graph = self.graphs.get((p, kind))
        if graph is not None:
            graph.replay()
        else:
            self._run(p, kind)
            if self.use_graphs:
                try:
                    self._capture(p, kind)
                except RuntimeError as err:  # a capture the driver refuses: stay on eager launches
                    logger.warning("sampler CUDA graphs off: %s", err)
                    self.use_graphs = False
                    self.graphs.clear()
        return self.tokens[:B]

    def _run(self, p: int, kind: BatchKind) -> None:
        if kind not in self.compiled and p != self.max_batch:
            # the first of a kind at the largest size, so its autotuned choices fit every size
            self._draw(self.max_batch, kind)
        self.compiled.add(kind)
        self._draw(p, kind)

    def _draw(self, p: int, kind: BatchKind) -> None:
        self.tokens[:p].copy_(draw(self.logits[:p], self.numbers[:, :p], self.keys[:p], kind))

    def _capture(self, p: int, kind: BatchKind) -> None:
        # capturing only records: the logits it would scale in place are left as the eager run left them
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._draw(p, kind)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[(p, kind)] = graph

    @torch.inference_mode()
    def warm_up(self, kinds: tuple[BatchKind, ...]) -> None:
        """Compile the kernels of each kind (an eager run at the largest size) and capture its
        graphs for every size, on neutral inputs."""
        self.numbers.zero_()
        self.keys.zero_()
        for kind in kinds:
            for p in sorted(self.ladder, reverse=True):
                self._run(p, kind)
                if self.use_graphs:
                    self._capture(p, kind)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("sampler %s for %d kinds of batch", "CUDA graphs captured" if self.use_graphs
                    else "kernels warmed up", len(kinds))


# what clients send by default: top-p alone, top-k alone (40-50), both, and min-p with top-p
DEFAULT_KINDS = (BatchKind(0, True, False), BatchKind(64, False, False), BatchKind(64, True, False),
                 BatchKind(0, True, True), BatchKind(0, False, False))
