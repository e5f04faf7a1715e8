#!/usr/bin/env python
"""Layer benchmark (same as `lrmoe bench layer`); see lrmoe/bench/layer.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing

from lrmoe.bench.layer import main  # noqa: E402

if __name__ == "__main__":
    main()
