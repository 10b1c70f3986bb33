"""The OpenAI-compatible HTTP server (``tianxia serve``): FastAPI over :class:`AsyncLLMEngine`."""

from tianxia.server.launcher import add_serve_args, run_server

__all__ = ["add_serve_args", "run_server"]
