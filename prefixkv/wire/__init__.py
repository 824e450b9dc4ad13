"""Wire contracts every layer shares: what goes over a socket between workers, routers and clients.

Owns the KV events' schema and block hashes (:mod:`.kv_events`) and the router's fan-out answer
(:mod:`.fanout`). Imports nothing of prefixkv above ``prefixkv.tiers.keys``; anything may import it.
"""
