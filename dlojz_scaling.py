"""`python dlojz_scaling.py --summary S --machine M --gpus ...`: the scaling forecast, or the
all-reduce probe under torchrun (dlojzlib/measure/scaling.py; `python -m dlojzlib.measure.scaling`
runs it too)."""
import sys

from dlojzlib.measure.scaling import main

if __name__ == '__main__':
    sys.exit(main())
