"""Multimodal serving: image loading and limits, mm_hash, the vision encoder protocol,
the classifier-bridge encoder, the embedding cache and embedding transfer (DESIGN.md §10)."""
