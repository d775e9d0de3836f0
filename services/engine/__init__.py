"""relay's inference engine: plain-PyTorch decoders (models/, on layers/) with continuous batching
(scheduler.py), a paged KV cache with prefix caching (kv_cache.py, block_manager.py) and chunked
prefill; llm_engine.py runs the step loop, model_runner.py the model on its device.

LLMEngine(model_dir, EngineConfig)   synchronous, in-process: generate(), step(), load_weights()
AsyncEngine(engine).start()          background step loop: await submit(), await load_weights()
"""

from services.engine.async_engine import AsyncEngine
from services.engine.llm_engine import InvalidRequest, LLMEngine
from services.engine.loader import WeightsError

__all__ = ["AsyncEngine", "InvalidRequest", "LLMEngine", "WeightsError"]
