"""Serving: an OpenAI-compatible HTTP server over compiled plans (`aviatorc serve`).

    aviatorc serve build/model.avc --tokenizer tok/ --port 8000 --max-num-seqs 8

- `engine`: continuous batching over a `Session`'s KV slots, priorities, deadlines, preemption;
- `speculative`: a draft model's tokens verified by the target in one step;
- `tenants`: several artifacts at once, each on its own chiplets;
- `protocol` and `app`: the OpenAI request bodies and endpoints (FastAPI, SSE);
- `metrics`: Prometheus series; `server`: uvicorn on a bound socket.

See docs/serving.md.
"""

from aviatorc.serve.engine import Engine, Finished, GenerationRequest, QueueFull, Token

__all__ = ["Engine", "Finished", "GenerationRequest", "QueueFull", "Token"]
