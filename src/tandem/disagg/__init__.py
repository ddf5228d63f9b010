"""Disaggregated prefill/decode: orchestration and the KV transfer layer (`.transfer`)."""
