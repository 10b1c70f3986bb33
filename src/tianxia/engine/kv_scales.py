"""The fp8 KV cache's per-layer scales from a calibration prefill (vLLM's ``--calculate-kv-scales``).

One prefill of a fixed text runs through the model with a float cache in the model dtype; each
layer's K and V absolute maxima, read back from that cache (the values the fp8 cache would
store: after the q/k norms and RoPE), give ``scale = max(amax, 1) / target``: the calibration's
largest K lands at 200 and its largest V at 100, vLLM's constants, which leave e4m3's range up to
448 as headroom for tokens larger than any the calibration text produced (clipped, they would
cost more than rounding does).

The floor: an amax below 1 would make the scale smaller than 1/448, and a layer whose
calibration K or V is all zeros would get scale 0 (a division by zero in the write). e4m3 has the
same relative precision (3 mantissa bits) over its whole normal range, so a smaller scale only
helps values that would otherwise fall below its smallest normal, 2^-6: with the floor those
are values below 2^-6 / 200, about 8e-5, negligible next to any value near 1 in the same layer.
"""

from __future__ import annotations

import logging

import torch

from tianxia.config import CacheConfig, ModelConfig
from tianxia.engine.model_runner import ModelRunner
from tianxia.engine.step_io import TokenRun, prepare_batch

logger = logging.getLogger(__name__)

# where the calibration's largest K and V land (vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT);
# e4m3's largest value is 448
TARGETS = (200.0, 100.0)
AMAX_FLOOR = 1.0

# prose, code and numbers: a mix of the token kinds a served model meets
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
    "presses in more than two hundred cities had printed over twenty million books.\n\n"
    "def fibonacci(n: int) -> list[int]:\n"
    "    seq = [0, 1]\n"
    "    while len(seq) < n:\n"
    "        seq.append(seq[-1] + seq[-2])\n"
    "    return seq[:n]\n\n"
    "Q: What is 17 * 24 + 3.5?\nA: 17 * 24 = 408, and 408 + 3.5 = 411.5.\n"
    "Le soleil se couchait sur la mer; die Kinder spielten noch am Strand. 夕日が海に沈む。"
)


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 scales for ``[..., 2]`` (K, V) absolute maxima ``amax``."""
    return amax.float().clamp(min=AMAX_FLOOR) / torch.tensor(TARGETS, device=amax.device)


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, model_config: ModelConfig, token_ids: list[int],
                        device: torch.device, dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """Per-layer ``[num_layers, 2]`` (K, V) float32 scales on ``device`` from one prefill of
    ``token_ids`` through ``model`` with a ``dtype`` cache."""
    n = len(token_ids)
    blocks = (n + block_size - 1) // block_size
    runner = ModelRunner(model, model_config, CacheConfig(block_size=block_size, num_blocks=blocks + 1),
                         device, dtype)
    run = TokenRun(list(token_ids), 0, list(range(blocks)))
    ids, pos, meta = runner.tensors(prepare_batch([(run, n)], block_size)[1])
    model(ids, pos, runner.kv_caches, meta)
    # the cache starts zeroed, so its maxima are those of the calibration tokens' K and V
    amax = runner.kv_cache.abs().amax(dim=(2, 3, 4, 5))
    scales = scales_from_amax(amax)
    logger.info("fp8 KV scales from a %d-token calibration prefill: K %.4g..%.4g, V %.4g..%.4g", n,
                scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max())
    return scales
