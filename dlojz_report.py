"""`python dlojz_report.py RUNS...`: the report over run folders (dlojzlib/tools/report.py; `python
-m dlojzlib.tools.report` runs it too)."""
import sys

from dlojzlib.tools.report import cli

if __name__ == '__main__':
    sys.exit(cli())
