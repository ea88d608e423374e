"""Prefill/decode disaggregation: SGLang's protocol, so the real `sglang-router` fronts us.

- `bootstrap.py`: the prefill's bootstrap HTTP server (`PUT/GET /route`, `/health`) and its client.
- `protocol.py`: room states and the ZMQ frames between the two roles.
- `kv_regions.py`: which bytes a token owns (every layer's MLA entry, every indexer key, the MTP
  layer's entry) as transfer segments, plus the per-room checksums.
- `aux_record.py`: the first sampled token and its logprob, one fixed-size record per room.
- `transfer/`: the transfer-engine seam (NIXL, Mooncake).
- `prefill.py` / `decode.py`: the two roles, wrapped around an `Engine`.
"""
