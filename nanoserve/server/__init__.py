"""Serving over HTTP: the engine in a thread of its own (`async_engine`), OpenAI's request shapes (`protocol`) and
response shapes (`responses`), the limits that guard the engine (`limits`), a request's outputs as they come
(`streams`), Prometheus metrics (`metrics`), the FastAPI app (`app`) and the command (`serve`). FastAPI and
uvicorn are imported only when a server is built."""

from .async_engine import AsyncEngine, EngineDraining, EngineStopped

__all__ = ["AsyncEngine", "EngineDraining", "EngineStopped"]
