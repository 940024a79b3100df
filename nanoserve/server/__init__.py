"""Serving over HTTP: the engine in a thread of its own (`async_engine`), OpenAI's request shapes
(`protocol`), Prometheus metrics (`metrics`) and the FastAPI app (`app`). FastAPI and uvicorn are
imported only when a server is built."""

from .async_engine import AsyncEngine, EngineDraining

__all__ = ["AsyncEngine", "EngineDraining"]
