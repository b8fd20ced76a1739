"""A small paged-KV LLM inference engine: Llama-family models, continuous batching, preemption, prefix caching."""
