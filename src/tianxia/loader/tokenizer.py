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


def _cache_dir(gguf_path: Path) -> Path:
    from tianxia.loader.hub import tianxia_home

    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
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
    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cache))
    except OSError as e:
        logger.warning("could not cache the tokenizer at %s: %s", cache, e)
    return tok
