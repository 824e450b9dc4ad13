"""Adapters that give other inference engines prefixkv's KV tiers.

``prefixkv.integrations.vllm``: a KV connector for vLLM (``PrefixKVConnector``), see docs/vllm.md.
``prefixkv.integrations.sglang``: an L3 storage backend for SGLang's HiCache
(``PrefixKVStorage``), see docs/sglang.md.
Each adapter imports its engine lazily: importing this package needs neither vLLM nor torch.
"""
