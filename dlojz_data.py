"""`python dlojz_data.py prepare SRC DST`: the data tools: shards from an ImageFolder
(dlojzlib/data/shards.py; `python -m dlojzlib.data.shards` runs it too)."""
import sys

from dlojzlib.data.shards import main

if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
