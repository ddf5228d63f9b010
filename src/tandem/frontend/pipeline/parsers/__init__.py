"""Tool-call and reasoning parsers: the model's own markup in generated text → OpenAI
`tool_calls` and `reasoning_content` (whole texts and streamed deltas). `registry.py` chooses
them by name and from a chat template."""
