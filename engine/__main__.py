"""`python -m engine run-trace ...`: the old spelling of `python -m cli run-trace ...`, kept for scripts.

The one place the engine package reaches into cli (tests/test_layering.py allows exactly this module).
Without `--db` nothing of storage is imported.
"""

from __future__ import annotations

import sys

from cli import run_trace
from cli.__main__ import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m engine", commands=(run_trace,)))
