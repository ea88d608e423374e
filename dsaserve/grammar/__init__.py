"""Structured output: grammars compiled per schema, one matcher per request, token bitmasks.

`backend` is the seam (xgrammar, llguidance), `compiler` compiles off the engine step with a
cache, `state` follows one request (armed until `</think>` when reasoning is on), `bitmask`
masks a batch of logits rows, `tool_calls` builds tool-call grammars in each model's own format.
"""
