"""Owns: Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).
Imports: the server core and ``server.openai`` (a Messages request runs as a chat completion).
"""
