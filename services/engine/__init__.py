"""relay's inference engine: a plain-PyTorch Qwen3/Llama decoder with continuous batching, a paged
KV cache with prefix caching, and chunked prefill.

LLMEngine(model_dir, EngineConfig)   synchronous, in-process: generate(), step(), load_weights()
AsyncEngine(engine).start()          background step loop: await submit(), await load_weights()
"""

from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import InvalidRequest, LLMEngine
from services.engine.loader import WeightsError

__all__ = ["AsyncEngine", "InvalidRequest", "LLMEngine", "WeightsError"]
