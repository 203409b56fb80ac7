"""`python dlojz_slurm.py --machine M --gpus N ...`: a SLURM script for a machine, printed, written
or submitted (dlojzlib/tools/slurm.py; `python -m dlojzlib.tools.slurm` runs it too)."""
import sys

from dlojzlib.tools.slurm import main

if __name__ == '__main__':
    sys.exit(main())
