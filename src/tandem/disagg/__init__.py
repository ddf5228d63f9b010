"""Disaggregated prefill/decode: orchestration and the KV transfer layer (`tandem.disagg.transfer`)."""
