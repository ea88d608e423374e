"""OpenAI-compatible routes: request models and serving (chat, completions, native /generate)."""
