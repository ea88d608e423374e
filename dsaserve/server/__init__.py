"""The HTTP server: API process (FastAPI) in front of the engine process (ZMQ)."""
