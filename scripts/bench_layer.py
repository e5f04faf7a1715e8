#!/usr/bin/env python
"""Layer benchmark (same as `lrmoe bench layer`); see lrmoe/bench/layer.py."""
from lrmoe.bench.layer import main

if __name__ == "__main__":
    main()
