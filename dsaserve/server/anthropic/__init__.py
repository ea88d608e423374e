"""Anthropic Messages API: request models, translation to chat, serving."""
