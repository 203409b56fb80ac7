"""`python dlojz_bench.py corpus|compare ...`: the decoder benchmark per core
(dlojzlib/tools/bench.py; `python -m dlojzlib.tools.bench` runs it too)."""
import sys

from dlojzlib.tools.bench import main

if __name__ == '__main__':
    sys.exit(main())
