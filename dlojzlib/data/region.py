"""--decode fast's region decoder: libjpeg-turbo's partial decompression through NVIDIA's
nvImageCodec (CPU backend). data.decode.FastTrainTransform decides when to use it;
docs/dependencies.md says why this binding."""
import importlib
import importlib.metadata
import importlib.util
import multiprocessing as mp
import os
import re
import sys
import tempfile

import numpy as np


# What nvImageCodec prints on stderr when imported (and at its first decode) without the CUDA
# libraries of its GPU extensions (nvJPEG, nvJPEG2000, nvTIFF), which its CPU backend does not use:
# several lines each.
_ABSENT_EXTENSION = re.compile(r"Failed to load nv\w+ library"
                               r"|If using nvImageCodec's Python distribution"
                               r"|Decoders and encoders will not be registered")


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


MODULE = 'nvidia.nvimgcodec'
WHEEL = re.compile(r'nvidia-nvimgcodec-cu(\d+)$')  # one wheel per CUDA major version


def why_not_nvimgcodec():
    """Why nvImageCodec will not decode in this run, or None: the wheel found without importing it
    (importlib's find_spec reads the path; the import itself loads every extension, and the nvJPEG
    one the CUDA driver). DLOJZ_REGION_DECODE=0 turns it off (the benchmark's comparison, a
    suspected decoder bug), for --decode gpu too."""
    if os.environ.get('DLOJZ_REGION_DECODE', '1') == '0':
        return 'turned off by DLOJZ_REGION_DECODE=0'
    try:
        found = importlib.util.find_spec(MODULE) is not None
    except ImportError:  # no nvidia package at all
        found = False
    if not found:
        return 'nvidia-nvimgcodec-cu12 is not installed (pip install -r requirements.txt)'
    return None


def import_nvimgcodec():
    """NVIDIA's nvImageCodec, imported quietly, or ImportError. Called where a decoder is made: in
    each process at its first region decode, in the decode thread once it is on the run's GPU."""
    # its import loads every extension, and those without their CUDA library say so at length
    return _made_quietly(lambda: importlib.import_module(MODULE))


def nvimgcodec_version():
    """The version of the installed wheel that holds nvImageCodec (e.g. '0.9.0.20'), read from its
    metadata without importing it; None where no nvidia-nvimgcodec-cuNN distribution holds the
    module found (a source build)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        return None
    where = os.path.realpath(spec.origin)
    for dist in importlib.metadata.distributions():
        if WHEEL.match(dist.metadata['Name'] or '') and \
                os.path.realpath(dist.locate_file('nvidia/nvimgcodec/__init__.py')) == where:
            return dist.version
    return None


class RegionDecoder:
    """Decode only a region of a JPEG: libjpeg-turbo's jpeg_skip_scanlines() and
    jpeg_crop_scanline() through nvImageCodec's CPU backend (PyPI nvidia-nvimgcodec-cu12; no GPU or
    CUDA needed). The pixels are those of a full decode's crop, bit for bit (libjpeg-turbo's same
    IDCT and upsampling; tests/test_handover checks it), so the path taken changes no sample. One
    decoder per process, made on first use, nvImageCodec imported then: a forked worker makes its
    own, and `import dlojz` imports nothing of it. `why_not` (None: it decodes) is known without
    importing it; `counts` (shared with the workers) says how many images each path decoded."""

    def __init__(self):
        self.why_not = why_not_nvimgcodec()
        self._pid = self._lib = self._decoder = self._params = None
        self._version = None
        self.counts = mp.get_context('fork').Array('q', 3)  # region, whole file (DCT-scaled), PIL

    @property
    def version(self):
        """The wheel's version, None when it does not decode; read once (a scan of the installed
        distributions)."""
        if self.why_not is not None:
            return None
        if self._version is None:
            self._version = nvimgcodec_version()
        return self._version

    def reset(self):
        for k in range(3):
            self.counts[k] = 0

    def count(self, k):
        with self.counts.get_lock():
            self.counts[k] += 1

    def __call__(self, data, top, left, h, w):
        """-> uint8 (h, w, 3) RGB, or None when nvImageCodec refuses the file (the caller decodes it
        whole)."""
        if self._pid != os.getpid():  # this process's first decode loads the extensions: quietly
            return _made_quietly(lambda: self._first(data, top, left, h, w))
        return self._decode(data, top, left, h, w)

    def _first(self, data, top, left, h, w):
        """This process's first decode: nvImageCodec imported, its CPU decoder made."""
        try:
            self._lib = n = import_nvimgcodec()
        except ImportError as e:  # found but broken (a library it links is missing)
            self.why_not = f'nvImageCodec could not be imported ({str(e).strip()[:120]})'
            print(f'dlojz: warning: {self.why_not}; --decode fast decodes whole files.',
                  file=sys.stderr, flush=True)
            return None
        self._decoder = n.Decoder(device_id=n.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                  backends=[n.Backend(n.BackendKind.CPU_ONLY)])
        # the crop is drawn from the header's size, unrotated (as simplejpeg and PIL decode it)
        self._params = n.DecodeParams(apply_exif_orientation=False, color_spec=n.SRGB,
                                      sample_format=n.I_RGB)
        self._pid = os.getpid()
        return self._decode(data, top, left, h, w)

    def _decode(self, data, top, left, h, w):
        n = self._lib
        crop = n.Region(top, left, top + h, left + w)
        stream = n.CodeStream(data).get_sub_code_stream(region=crop)
        img = self._decoder.decode(stream, params=self._params)
        if img is None:
            return None
        arr = np.asarray(img.cpu())
        return arr if arr.shape == (h, w, 3) else None


REGION = RegionDecoder()
