"""Backends: ``Runtime`` (in-process engine), ``RuntimeEndpoint`` (``tianxia serve``), ``OpenAI``
(any OpenAI-compatible server)."""

from tianxia.lang.backend.base import BaseBackend
from tianxia.lang.backend.openai import OpenAI, SelectUnsupportedError
from tianxia.lang.backend.runtime_endpoint import RuntimeEndpoint

__all__ = ["BaseBackend", "OpenAI", "RuntimeEndpoint", "SelectUnsupportedError"]
