"""The KV store gateway: content-addressed KV pages in tiers (RAM -> disk -> Mooncake); docs/kv.md."""
