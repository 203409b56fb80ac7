"""--decode gpu's decoder where it can: NVIDIA nvImageCodec decodes each batch in one call, only the
crop of each JPEG (its regions), on the GPU's hardware JPEG engines (A100, H100, H200: nvJPEG's
hardware backend) or its CUDA backend elsewhere, on the decode stream it is given. torchvision's
decode_jpeg, which decodes whole images with nvJPEG's CUDA backend only, stays the fallback
(data.gpu_decode.DeviceDecode says which decodes, and why).

Which wheel: nvImageCodec is built per CUDA major version (nvidia-nvimgcodec-cu12, -cu13), and its
GPU decoders load that version's nvJPEG (nvidia-nvjpeg-cu12; nvidia-nvjpeg 13 for CUDA 13). It must
match the CUDA torch was built for (torch.version.cuda); requirements.txt installs the cu12 wheel,
whose CPU backend --decode fast uses anywhere. The same API's CPU backend decodes here on the CPU:
the seam the tests drive, pixel for pixel against --decode fast (the same libjpeg-turbo)."""
import importlib.metadata
import re

import numpy as np
import torch

from dlojzlib.data import region

WHEEL = re.compile(r'nvidia-nvimgcodec-cu(\d+)$')


def wheel_cuda_major(names):
    """The CUDA major versions of the nvImageCodec wheels among installed distribution names."""
    return sorted({int(m.group(1)) for m in map(WHEEL.match, names) if m})


def installed_names():
    return [d.metadata['Name'] or '' for d in importlib.metadata.distributions()]


def usable(lib, why_not, device, torch_cuda, wheels):
    """Whether nvImageCodec can decode this run's batches on `device` -> (True, None), or (False,
    the reason in a few words). Facts in: the module or None (and why), the device, torch's CUDA
    version ('13.0', None on a CPU build), the CUDA majors of the installed nvImageCodec wheels."""
    if lib is None:
        return False, why_not
    if device.type != 'cuda':
        return True, None  # its CPU backend: the tests' seam
    major = int(torch_cuda.split('.')[0]) if torch_cuda else None
    if major not in wheels:
        have = ', '.join(f'nvidia-nvimgcodec-cu{w}' for w in wheels) or 'no wheel'
        nvjpeg = 'nvidia-nvjpeg-cu12' if major == 12 else 'nvidia-nvjpeg'
        return False, (f'torch is built for CUDA {torch_cuda} and {have} is installed; pip install '
                       f'nvidia-nvimgcodec-cu{major} {nvjpeg} for its GPU decoders')
    return True, None


class NvDecoder:
    """nvImageCodec's decoder for one device, made in the thread that decodes (DecodeAhead's, whose
    current device is the run's): the GPU's backends, the hardware engine first; on a CPU device its
    CPU backend. Images come back planar RGB, unrotated (the crop was drawn from the header's size,
    as every other path draws it)."""

    def __init__(self, lib, device):
        self.lib, self.device = lib, device
        n = lib
        if device.type == 'cuda':
            backends = [n.Backend(n.BackendKind.HW_GPU_ONLY), n.Backend(n.BackendKind.GPU_ONLY),
                        n.Backend(n.BackendKind.HYBRID_CPU_GPU)]
            self.decoder = region._made_quietly(
                lambda: n.Decoder(device_id=device.index, max_num_cpu_threads=4, backends=backends))
        else:
            self.decoder = region._made_quietly(
                lambda: n.Decoder(device_id=n.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                  backends=[n.Backend(n.BackendKind.CPU_ONLY)]))
        self.params = n.DecodeParams(apply_exif_orientation=False, color_spec=n.SRGB,
                                     sample_format=n.P_RGB)

    def __call__(self, chunks, boxes, stream=None):
        """JPEG bytes (uint8 CPU tensors) and their crop boxes -> [uint8 (3, h, w) tensor of the
        crop on the device, or None where nvImageCodec could not decode it], queued on `stream` (a
        torch.cuda.Stream; None on the CPU)."""
        n = self.lib
        sources = []
        for chunk, (top, left, h, w, _) in zip(chunks, boxes):
            try:
                region = n.Region(top, left, top + h, left + w)
                sources.append(n.CodeStream(chunk.numpy()).get_sub_code_stream(region=region))
            except RuntimeError:  # not a stream it parses: decoded by the fallback
                sources.append(None)
        given = [s for s in sources if s is not None]
        handle = stream.cuda_stream if stream is not None else 0
        decoded = iter(self.decoder.decode(given, params=self.params, cuda_stream=handle)
                       if given else [])
        return [self._tensor(next(decoded), box) if s is not None else None
                for s, box in zip(sources, boxes)]

    def _tensor(self, image, box):
        """A decoded image as a (3, h, w) tensor of its box's size, None where it is not one (the
        fallback decodes it): planar as asked, or interleaved where a backend ignored the layout."""
        if image is None:
            return None
        if self.device.type == 'cuda':
            # its __cuda_array_interface__: no copy
            x = torch.as_tensor(image, device=self.device)
        else:
            x = torch.from_numpy(np.asarray(image.cpu()))
        h, w = box[2], box[3]
        if tuple(x.shape) == (3, h, w):  # first: a 3 x 3 crop reads the same both ways
            return x
        return x.permute(2, 0, 1) if tuple(x.shape) == (h, w, 3) else None
