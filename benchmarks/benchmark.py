"""Thin wrapper: `python benchmarks/benchmark.py ...` = `python -m cutlass_flash.benchmark ...`."""

import os
import sys

try:
    from cutlass_flash.benchmark import main
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cutlass_flash.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
