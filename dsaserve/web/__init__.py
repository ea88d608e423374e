"""The HTTP pieces both faces use, below `server/` and `disaggregation/`: the error envelopes of
each API (`errors.py`), the JSON decoder's limits (`json_limits.py`) and uvicorn's connection and
header limits (`http_limits.py`)."""
