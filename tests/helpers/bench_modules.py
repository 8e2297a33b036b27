"""The benchmark drivers under bench/ as importable modules, for the tests that check them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str):
    """bench/<name>.py, imported (bench/ put on sys.path once: the drivers import each other)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)
