"""`python dlojz_loader.py ROOT`: the classic loader against dlojz's decode paths, per worker
(dlojzlib/modes/doctor.py; `python -m dlojzlib.modes.doctor` runs it too)."""
import sys

from dlojzlib.modes.doctor import compare_main

if __name__ == '__main__':
    sys.exit(compare_main())
