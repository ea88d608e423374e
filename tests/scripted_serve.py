"""`python tests/scripted_serve.py SCRIPTS|- real|alone [dsaserve serve flags]`: `dsaserve serve`
whose engine process drives tests/scripted_engine.py's double (with the real engine behind it, or
alone), handed to the server by this test entry point (server_harness.py starts it)."""

from __future__ import annotations

import sys

from scripted_engine import ScriptedEngineFactory

from dsaserve.server.launch import main

if __name__ == "__main__":
    scripts, engine, *flags = sys.argv[1:]
    factory = ScriptedEngineFactory(None if scripts == "-" else scripts, real=engine == "real")
    sys.exit(main(flags, engine_factory=factory))
