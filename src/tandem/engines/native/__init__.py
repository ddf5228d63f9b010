"""A small torch engine for llama-family models: paged KV cache, continuous batching,
prefix caching, KV block export/import. Default model: SmolLM2-135M-Instruct (GGUF)."""
