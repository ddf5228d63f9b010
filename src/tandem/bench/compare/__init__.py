"""Harnesses that measure tandem against other systems on the same machine and load:
Dynamo's frontend (`tandem bench frontend`) and vLLM's own server, with Dynamo's vLLM worker
beside it (`tandem bench vllm`)."""
