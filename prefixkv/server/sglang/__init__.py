"""Owns: SGLang's native API (``/generate``, ``/flush_cache``, ``/model_info``, ...), its logprobs.
Imports: the server core and ``server.openai.tools`` (the structured-output compile it shares).
"""
