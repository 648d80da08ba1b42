"""Test modules import the helpers in attention_numerics.py next to this file (pytest runs in importlib mode)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
