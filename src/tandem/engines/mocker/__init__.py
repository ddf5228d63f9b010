"""The mocker engine: no weights; simulates scheduling, paged KV with prefix reuse, chunked
prefill, preemption and step timing (DESIGN.md §8). Core (block pool, scheduler, perf model)
is synchronous and deterministic; only `engine.MockerEngine` is async."""
