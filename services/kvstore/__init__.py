"""KV pages across services (docs/kv.md): the KV store gateway, content-addressed pages in tiers
RAM -> disk -> Mooncake (server.py, tiers.py, dataplane.py, mooncake.py), and the engine side that
decode and prefill share: the gateway client (client.py), the near tier and same-host handoff
(near_cache.py, shared_segment.py, handoff.py), and the router that decides where a prompt's KV
comes from (router.py, pull_policy.py)."""
