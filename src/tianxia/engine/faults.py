"""Fault injection, to prove that one failing request does not take the others down.

Off unless ``TIANXIA_FAULT_INJECT`` is set (read once at import). Its value is a comma-separated
list of ``kind:trigger``; a fault of ``kind`` hits every request whose prompt text contains
``trigger``, at the point where a real fault of that kind would happen:

- ``detokenize``: the detokenizer raises on the request's first generated token;
- ``grammar``: the grammar matcher rejects the request's first generated token;
- ``nan``: the request's logits row becomes NaN (as a broken weight or an overflow would make it);
- ``engine_loop``: the engine loop itself raises once the request is taken in, outside any
  request's processing (the whole engine is then dead, and the server exits non-zero).

Example: ``TIANXIA_FAULT_INJECT="nan:@@nan@@,engine_loop:@@crash@@" tianxia serve ...``. With the
variable unset every hook is a lookup in an empty dict.
"""

from __future__ import annotations

import os
from typing import Any

ENV_VAR = "TIANXIA_FAULT_INJECT"
KINDS = ("detokenize", "grammar", "nan", "engine_loop")


class InjectedFault(RuntimeError):
    """A fault raised on purpose by ``TIANXIA_FAULT_INJECT``."""


def parse(spec: str) -> dict[str, str]:
    """``"kind:trigger,kind:trigger"`` to ``{kind: trigger}``; a bad spec is a ``ValueError``."""
    faults: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, sep, trigger = item.partition(":")
        if not sep or not trigger or kind not in KINDS:
            raise ValueError(
                f"{ENV_VAR}: {item!r} is not KIND:TRIGGER with KIND one of {', '.join(KINDS)}"
            )
        faults[kind] = trigger
    return faults


ACTIVE: dict[str, str] = parse(os.environ.get(ENV_VAR, ""))


def hits(kind: str, prompt: Any) -> bool:
    """Whether a fault of ``kind`` is armed for a request with this prompt text."""
    trigger = ACTIVE.get(kind)
    return trigger is not None and isinstance(prompt, str) and trigger in prompt
