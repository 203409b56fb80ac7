"""`python dlojz_export.py CHECKPOINT --out FILE [--aoti]`: a trained checkpoint for C++ (LibTorch)
with torch.export (dlojzlib/tools/export.py)."""
import sys

from dlojzlib.tools.export import main

if __name__ == '__main__':
    sys.exit(main())
