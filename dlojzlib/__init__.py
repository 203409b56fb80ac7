"""dlojz's library: what `python dlojz.py` runs, a folder per part (docs/development.md draws the
tree).

Importing it imports nothing else: `python dlojz.py --help` answers without torch."""
import os

# the repository: dlojz.py, slurm/, docs/
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'dlojz.py')  # the one entry point, which trials and probes start again
