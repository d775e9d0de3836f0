"""Prefill services and the decode-side routing to them (prefill/decode disaggregation); docs/kv.md."""
