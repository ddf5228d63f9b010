"""tandem: a distributed LLM inference server."""

__version__ = "0.1.0"
