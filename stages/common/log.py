"""Logging set-up shared by the stages' ``main()``."""
from __future__ import annotations

import logging
import os
import sys


def setup(name: str) -> logging.Logger:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    logging.basicConfig(
        level=os.environ.get("RAYFORGE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    return logging.getLogger(name)
