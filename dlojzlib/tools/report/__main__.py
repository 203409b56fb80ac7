"""`python -m dlojzlib.tools.report RUNS...` runs the report as `python dlojz_report.py` does."""
import sys

from dlojzlib.tools.report import cli

sys.argv[0] = 'python -m dlojzlib.tools.report'  # its --help and errors name the command
sys.exit(cli())
