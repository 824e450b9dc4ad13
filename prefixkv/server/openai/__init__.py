"""Owns: the OpenAI dialect (completions, chat, Responses) and vLLM's routes beside it.
Imports: the server core (bodies, errors, fields, limits, metrics, streaming, ...); no dialect.

``routes.py`` mounts completions and chat; requests run through
:class:`~prefixkv.server.openai.serving.OpenAIServing`, which the other
dialects that translate into a chat completion (Anthropic's Messages) call too. vLLM's routes
here: ``/tokenize`` / ``/detokenize`` / ``/tokenizer_info`` / ``/version`` and the render API.
"""
