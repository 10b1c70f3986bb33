"""Tokenizers: from a Hugging Face directory, or converted from GGUF metadata.

Converting a GGUF vocabulary with ``transformers`` takes seconds, so the converted tokenizer is
saved under ``$TIANXIA_HOME/tokenizers`` keyed by the file's identity and reused next time.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


_CACHE_VERSION = 2


def _fix_pre_tokenizer(tok: PreTrainedTokenizerBase, gguf_path: Path) -> None:
    """Restore the pre-tokenizer llama.cpp names in ``tokenizer.ggml.pre`` where transformers'
    GGUF conversion drops it: "smollm" splits digits before the byte-level regex (so "\n\n0"
    is "\n\n" + "0", as in SmolLM's own tokenizer.json and in llama.cpp)."""
    from tianxia.loader.gguf import GGUFFile

    pre = GGUFFile(gguf_path).metadata("tokenizer.ggml.pre")
    if pre == "smollm":
        from tokenizers import pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])


def _cache_dir(gguf_path: Path) -> Path:
    from tianxia.loader.hub import tianxia_home

    st = gguf_path.stat()
    # _CACHE_VERSION: bump when the conversion below changes, so stale entries are rebuilt
    key = hashlib.sha256(
        f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{_CACHE_VERSION}".encode()
    ).hexdigest()
    return tianxia_home() / "tokenizers" / key[:16]


def load_tokenizer(source: Path, *, is_gguf: bool) -> PreTrainedTokenizerBase:
    if not is_gguf:
        return AutoTokenizer.from_pretrained(str(source))
    cache = _cache_dir(source)
    if (cache / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:  # a damaged cache entry is rebuilt below
            logger.warning("rebuilding tokenizer cache at %s", cache)
    try:
        tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except ValueError as e:  # transformers reads the model config too, and knows fewer archs
        if "is not supported" not in str(e):
            raise
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(source.parent), gguf_file=source.name)
    _fix_pre_tokenizer(tok, source)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cache))
    except OSError as e:
        logger.warning("could not cache the tokenizer at %s: %s", cache, e)
    return tok
