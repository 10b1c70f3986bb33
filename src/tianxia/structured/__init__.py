"""Grammar-constrained decoding (JSON schema, regex, choice, EBNF) with xgrammar."""

from tianxia.structured.backend import GrammarBackend, StructuredOutputsParams

__all__ = ["GrammarBackend", "StructuredOutputsParams"]
