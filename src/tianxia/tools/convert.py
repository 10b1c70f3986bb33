"""``tianxia convert HF_DIR out.gguf --outtype f32|f16|bf16|q8_0``: a Hugging Face directory to GGUF.

Written with ``gguf.GGUFWriter`` in llama.cpp's conventions (what ``convert_hf_to_gguf.py``
writes), so llama.cpp loads the result:

- tensor names from :data:`tianxia.loader.gguf.TENSOR_NAMES` (llama.cpp's names per
  architecture); Mistral is written as ``llama``, as llama.cpp does;
- layouts: ``llama`` q/k rows permuted for interleaved RoPE, Gemma norms stored as ``1 + w``,
  GPT-2's ``Conv1D`` weights transposed, Falcon's fused qkv reordered to ``[q | k | v]``;
- hyper-parameters under ``{arch}.*`` (sliding windows and per-layer patterns, soft-caps, RoPE
  scaling, partial rotary dimensions);
- the tokenizer (BPE vocabulary, merges, special tokens, llama.cpp's pre-tokenizer name found by
  hashing a fixed text's token ids) and the chat template.

1-D tensors (norms, biases) stay float32, as llama.cpp's converter keeps them.
"""

from __future__ import annotations

import logging
import sys
import time
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tianxia.config import ModelConfig
from tianxia.loader.gguf import GPT2_CONV1D, hf_to_gguf_name
from tianxia.loader.safetensors import hf_model_config, hf_weights, read_hf_config

logger = logging.getLogger(__name__)

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
_GGUF_ARCH = {"mistral": "llama"}


def _permute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF rotate-half q/k rows -> llama.cpp's interleaved layout (inverse of the loader's unpermute)."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(cfg: ModelConfig, weights, arch: str):
    """Yield ``(gguf_name, float32 tensor in GGUF layout)``."""
    from tianxia.models.falcon import falcon_qkv_to_standard

    two_ln = arch == "falcon" and cfg.extra.get("num_ln_in_parallel_attn") == 2 and cfg.extra.get(
        "new_decoder_architecture"
    )
    for name, tensor in weights:
        if name.endswith((".attn.bias", ".attn.masked_bias")) or "rotary_emb.inv_freq" in name:
            continue
        if arch == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = hf_to_gguf_name(name, cfg.architecture, two_ln)
        if gname is None:
            raise ValueError(f"tensor {name!r} has no GGUF name for architecture {cfg.architecture!r}")
        t = tensor.float()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            t = _permute_rope_rows(t, heads)
        elif cfg.architecture in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1
        elif arch == "gpt2" and name.endswith(".weight") and any(c in name for c in GPT2_CONV1D):
            t = t.t()
        elif arch == "falcon" and ".query_key_value." in name:
            t = falcon_qkv_to_standard(t, cfg)
        yield gname, t.contiguous()


def _tensor_type(name: str, t: torch.Tensor, outtype: str):
    from gguf import GGMLQuantizationType as QT

    from tianxia.quant.quantize import allows_quantization

    if t.dim() < 2 or outtype == "f32" or not allows_quantization(name, t.dim()):
        return QT.F32
    if outtype == "q8_0" and t.shape[-1] % 32 == 0:
        return QT.Q8_0
    return {"f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.F16}[outtype]


def _add_hparams(w, cfg: ModelConfig, raw: dict[str, Any], arch: str) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads or arch in ("gemma2", "gemma3"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in ("gpt2", "falcon"):
        w.add_layer_norm_eps(cfg.rms_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
    if arch == "falcon":
        w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    if arch != "gpt2":
        w.add_rope_dimension_count(rot)
    s = cfg.rope_scaling
    if s:
        from gguf import RopeScalingType

        kind = s.get("rope_type", s.get("type"))
        if kind in ("linear", "yarn"):
            w.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(s["factor"]))
            if s.get("original_max_position_embeddings"):
                w.add_rope_scaling_orig_ctx_len(int(s["original_max_position_embeddings"]))
            if kind == "yarn":
                for key, fn in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                                ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                                ("attention_factor", w.add_rope_scaling_attn_factors)):
                    if s.get(key) is not None:
                        fn(float(s[key]))
        elif kind == "llama3":
            # llama.cpp applies llama3 scaling through a precomputed rope_freqs tensor (see below)
            pass
        else:
            raise ValueError(f"RoPE scaling {kind!r} cannot be written to GGUF (llama.cpp has no equivalent)")
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
        if cfg.layer_types is not None:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if cfg.rope_local_theta is not None:
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
    if cfg.attn_logit_softcapping:
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))


def _llama3_rope_freqs(cfg: ModelConfig) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor: per-frequency divisors implementing llama3 scaling."""
    from tianxia.layers.rotary import _llama3_inv_freq

    d = int(cfg.head_dim * cfg.partial_rotary_factor)
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return (base / _llama3_inv_freq(base, cfg.rope_scaling)).numpy().astype(np.float32)


def _add_tokenizer(w, model_dir: Path, vocab_size: int) -> None:
    import gguf
    from transformers import AutoTokenizer

    from tianxia.tools._bpe_pre import CHKTXT, PRE_TOKENIZERS

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = tok.get_vocab()
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = reverse[i]
        if t in added:
            special = decoder[i].special if i in decoder else False
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    chkhsh = sha256(str(tok.encode(CHKTXT)).encode()).hexdigest()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZERS.get(chkhsh, "default"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(w)
    if not special.chat_template and getattr(tok, "chat_template", None):
        w.add_chat_template(tok.chat_template)


def convert(model_dir: str | Path, out: str | Path, outtype: str = "f16", *, progress: bool = True) -> dict:
    """Write ``model_dir`` as a GGUF file; returns a small summary."""
    import gguf
    from tqdm import tqdm

    from tianxia.quant.quantize import quantize_array

    if outtype not in OUTTYPES:
        raise ValueError(f"--outtype must be one of {', '.join(OUTTYPES)}")
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.model").exists() and not (model_dir / "tokenizer.json").exists():
        raise ValueError(f"{model_dir}: SentencePiece-only tokenizers are not supported; need tokenizer.json")
    cfg = hf_model_config(model_dir)
    raw = read_hf_config(model_dir)
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim and not (
        cfg.num_hidden_layers in (46, 62) and cfg.query_pre_attn_scalar == cfg.hidden_size // cfg.num_attention_heads
    ):
        logger.warning("query_pre_attn_scalar=%s differs from what llama.cpp assumes for this model "
                       "(head_dim=%d); GGUF has no key for it", cfg.query_pre_attn_scalar, cfg.head_dim)
    arch = _GGUF_ARCH.get(cfg.architecture, cfg.architecture)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(raw.get("_name_or_path") or model_dir.name)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    w.add_file_type(int(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(w, cfg, raw, arch)
    _add_tokenizer(w, model_dir, cfg.vocab_size)

    tensors = list(gguf_tensors(cfg, hf_weights(model_dir), arch))
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "llama3":
        tensors.insert(0, ("rope_freqs.weight", torch.from_numpy(_llama3_rope_freqs(cfg))))
    n_params = 0
    for name, t in tqdm(tensors, desc=f"convert {outtype}", unit="tensor", file=sys.stderr,
                        disable=not progress):
        qt = _tensor_type(name, t, outtype)
        x = t.numpy().astype(np.float32)
        n_params += x.size
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            data = quantize_array(x.reshape(-1, x.shape[-1]), qt)
            w.add_tensor(name, data.reshape(*x.shape[:-1], -1), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    size = Path(out).stat().st_size
    return {"architecture": arch, "tensors": len(tensors), "params": n_params, "bytes": size,
            "outtype": outtype, "seconds": time.perf_counter() - t0}
