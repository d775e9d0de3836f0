"""The prefill service (prefill/decode disaggregation): computes long prompts' pages and first
tokens for decode; decode reaches it through services/kvstore/router.py. docs/kv.md."""
