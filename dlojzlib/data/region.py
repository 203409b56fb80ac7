"""--decode fast's region decoder: libjpeg-turbo's partial decompression through NVIDIA's
nvImageCodec (CPU backend). data.decode.FastTrainTransform decides when to use it;
docs/dependencies.md says why this binding."""
import importlib
import multiprocessing as mp
import os
import re
import sys
import tempfile

import numpy as np


# What nvImageCodec prints on stderr when imported (and at its first decode) without the CUDA
# libraries of its GPU extensions (nvJPEG, nvJPEG2000, nvTIFF), which its CPU backend does not use:
# several lines each.
_ABSENT_EXTENSION = re.compile(r"Failed to load nv\w+ library|If using nvImageCodec's Python distribution|"
                               r"Decoders and encoders will not be registered")


def _made_quietly(make):
    """make(), with fd 2 captured meanwhile: the absent-extension lines are dropped, any other line
    is passed on to stderr (another thread's too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            return make()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors='replace').splitlines(True)
                    if not _ABSENT_EXTENSION.search(line)]
            if kept:
                sys.stderr.write(''.join(kept))
                sys.stderr.flush()


def _import_nvimgcodec():
    """NVIDIA's nvImageCodec, whose CPU backend is libjpeg-turbo with partial decompression, or None
    with the reason. DLOJZ_REGION_DECODE=0 turns it off (the benchmark's comparison, a suspected
    decoder bug)."""
    if os.environ.get('DLOJZ_REGION_DECODE', '1') == '0':
        return None, 'turned off by DLOJZ_REGION_DECODE=0'
    try:
        # its import loads every extension, and those without their CUDA library say so at length
        nvimgcodec = _made_quietly(lambda: importlib.import_module('nvidia.nvimgcodec'))
    except ImportError:
        return None, 'nvidia-nvimgcodec-cu12 is not installed (pip install -r requirements.txt)'
    return nvimgcodec, None


class RegionDecoder:
    """Decode only a region of a JPEG: libjpeg-turbo's jpeg_skip_scanlines() and
    jpeg_crop_scanline() through nvImageCodec's CPU backend (PyPI nvidia-nvimgcodec-cu12; no GPU or
    CUDA needed). The pixels are those of a full decode's crop, bit for bit (libjpeg-turbo's same
    IDCT and upsampling; tests/test_handover checks it), so the path taken changes no sample. One
    decoder per process, made on first use: a forked worker makes its own. `counts` (shared with the
    workers) says how many images each path decoded."""

    def __init__(self):
        self.lib, self.why_not = _import_nvimgcodec()
        self._pid = self._decoder = self._params = None
        self.counts = mp.get_context('fork').Array('q', 3)  # region, whole file (DCT-scaled), PIL

    @property
    def version(self):
        return getattr(self.lib, '__version__', None)

    def reset(self):
        for k in range(3):
            self.counts[k] = 0

    def count(self, k):
        with self.counts.get_lock():
            self.counts[k] += 1

    def __call__(self, data, top, left, h, w):
        """-> uint8 (h, w, 3) RGB, or None when nvImageCodec refuses the file (the caller decodes it
        whole)."""
        if self._pid != os.getpid():  # the first decode of this process loads the extensions: quietly
            n = self.lib
            self._decoder = n.Decoder(device_id=n.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                      backends=[n.Backend(n.BackendKind.CPU_ONLY)])
            # the crop is drawn from the header's size, unrotated (as simplejpeg and PIL decode it)
            self._params = n.DecodeParams(apply_exif_orientation=False, color_spec=n.SRGB,
                                          sample_format=n.I_RGB)
            self._pid = os.getpid()
            return _made_quietly(lambda: self._decode(data, top, left, h, w))
        return self._decode(data, top, left, h, w)

    def _decode(self, data, top, left, h, w):
        n = self.lib
        stream = n.CodeStream(data).get_sub_code_stream(region=n.Region(top, left, top + h, left + w))
        img = self._decoder.decode(stream, params=self._params)
        if img is None:
            return None
        arr = np.asarray(img.cpu())
        return arr if arr.shape == (h, w, 3) else None


REGION = RegionDecoder()
