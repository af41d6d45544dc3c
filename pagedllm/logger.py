"""The `pagedllm` logger: INFO lines (model loaded, KV cache size) on stderr, as vLLM prints them.

PAGEDLLM_LOG_LEVEL=WARNING silences them; an application that configures logging itself can do the same.
"""

from __future__ import annotations

import logging
import sys

from pagedllm import envs

logger = logging.getLogger("pagedllm")
if not logger.handlers:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s pagedllm: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(envs.LOG_LEVEL.get())
    logger.propagate = False
