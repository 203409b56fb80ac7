"""nvImageCodec is imported where a decoder is made, never by `import dlojz` (gpu review 5, F3): its
import loads every extension, and the nvJPEG one loads the CUDA driver and binds whichever libnvjpeg
the process holds (torchvision's), before a rank has chosen its GPU. Protected here, each in a fresh
Python process:

- `import dlojz` leaves nvidia.nvimgcodec out of sys.modules;
- --decode fast still decodes the crop's region after that (the shared counts say so), in a forked
  worker that imports it for itself and in the process that imported dlojz, quietly (none of the
  absent-extension lines on stderr);
- DLOJZ_REGION_DECODE=0 still turns the region decoder off, without importing nvImageCodec.

Run: python -m pytest -q tests/test_lazy_imports.py"""
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import ROOT

needs_wheel = pytest.mark.skipif(importlib.util.find_spec('nvidia') is None
                                 or importlib.util.find_spec('nvidia.nvimgcodec') is None,
                                 reason='nvidia-nvimgcodec-cu12 is not installed')


def python(code, env=None):
    """-> (stdout lines, stderr) of `code` run in a fresh interpreter at the repository's root."""
    p = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       timeout=180, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split(), p.stderr


# A 500 x 375 JPEG decoded by --decode fast at 224 px: no crop of it is twice 224 px, so the DCT
# scaling never applies and each image goes through the region decoder (tests/test_handover.py).
PHOTO = '''
import multiprocessing, random, sys, tempfile
import dlojz
from dlojzlib.data import datasets, decode
path = tempfile.mkdtemp() + '/a.JPEG'
datasets.synthetic_image(5, 'train', 5, 5, 10).resize((500, 375)).save(path, 'JPEG', quality=90)
fast = decode.FastTrainTransform(224)
'''
FAST_DECODE = PHOTO + '''
print('imported_at_start', 'nvidia.nvimgcodec' in sys.modules)
worker = multiprocessing.get_context('fork').Process(
    target=lambda: [fast(path, random.Random(i)) for i in range(3)])
worker.start()
worker.join()
print('worker_exit', worker.exitcode)
print('imported_after_worker', 'nvidia.nvimgcodec' in sys.modules)
print('regions_after_worker', decode.REGION.counts[0])
fast(path, random.Random(3))
print('regions', decode.REGION.counts[0], 'whole', decode.REGION.counts[1])
print('imported_after_decode', 'nvidia.nvimgcodec' in sys.modules)
'''


@needs_wheel
def test_a_fast_decode_imports_nvimgcodec_itself_and_decodes_the_region():
    """`import dlojz` leaves nvImageCodec unimported (imported_at_start: it was True on 103aea5);
    a forked worker imports it at its first decode (the parent still has not), the parent at its
    own; every image is a region decode, and the import's absent-extension lines (nvJPEG,
    nvJPEG2000, nvTIFF missing here) are not printed."""
    out, err = python(FAST_DECODE)
    said = dict(zip(out[::2], out[1::2]))
    assert said == {'imported_at_start': 'False', 'worker_exit': '0',
                    'imported_after_worker': 'False', 'regions_after_worker': '3', 'regions': '4',
                    'whole': '0', 'imported_after_decode': 'True'}, out
    assert 'Failed to load' not in err and 'will not be registered' not in err, err


@needs_wheel
def test_region_decode_turned_off_imports_nothing_and_says_why():
    code = PHOTO + '''
fast(path, random.Random(0))
print(decode.REGION.counts[0], decode.REGION.counts[1], 'nvidia.nvimgcodec' in sys.modules)
print(decode.REGION.why_not)
'''
    out, _ = python(code, env={'DLOJZ_REGION_DECODE': '0'})
    assert out[:3] == ['0', '1', 'False']
    assert ' '.join(out[3:]) == 'turned off by DLOJZ_REGION_DECODE=0'
