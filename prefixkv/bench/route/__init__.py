"""The router benchmarks: scripted sessions replayed through routers (``prefixkv bench route``).

Owns the replays, their workloads, meters and reports, the routing-cost and endpoint-picker
benches and the side by side with the Rust routers. May import ``prefixkv.router`` (the thing
measured), ``prefixkv.cache`` and the standard library; nothing imports it but the CLI.
"""
