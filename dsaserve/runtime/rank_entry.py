"""`python -m dsaserve.runtime.rank_entry`: a spawned rank; its arguments come pickled on
stdin from the process that started it (see ranks.RankProcess)."""

from __future__ import annotations

import pickle
import sys

from dsaserve.runtime.ranks import rank_main

if __name__ == "__main__":
    rank_main(*pickle.loads(sys.stdin.buffer.read()))
