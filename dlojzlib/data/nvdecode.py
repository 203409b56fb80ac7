"""--decode gpu's decoder where it can: NVIDIA nvImageCodec decodes each batch in one call per
backend, only the crop of each JPEG (its regions), on the GPU's hardware JPEG engines (A100, H100,
H200: nvJPEG's hardware backend) where they take it, else its CUDA backend, on the decode stream it
is given, counting the images each backend decoded. torchvision's decode_jpeg, which decodes whole
images with nvJPEG's CUDA backend only, stays the fallback (data.gpu_decode.DeviceDecode says
which decodes, and why).

Which wheel: nvImageCodec is built per CUDA major version (nvidia-nvimgcodec-cu12, -cu13), and its
GPU decoders load that version's nvJPEG (nvidia-nvjpeg-cu12; nvidia-nvjpeg 13 for CUDA 13). It must
match the CUDA torch was built for (torch.version.cuda); requirements.txt installs the cu12 wheel,
whose CPU backend --decode fast uses anywhere. The same API's CPU backend decodes here on the CPU:
the seam the tests drive, pixel for pixel against --decode fast (the same libjpeg-turbo)."""
import importlib.metadata
import os
import re

import numpy as np
import torch

from dlojzlib.data import region

# nvImageCodec's backends for the crops, in the order its own chain tries them (name, BackendKind):
# on a GPU the hardware JPEG engine (A100, H100, H200), nvJPEG's CUDA decoder, its hybrid CPU/GPU
# decoder; on a CPU device libjpeg-turbo (the tests' seam). One Decoder holding the three hands an
# image the first refuses (a region the engine does not take, a decode that fails) to the next
# without a word, so that nothing would say which decoded; each is therefore a Decoder of its own,
# asked in turn for what those before it returned None for: at most one call per backend per batch,
# and a count of the images each decoded.
GPU_BACKENDS = (('hardware', 'HW_GPU_ONLY'), ('cuda', 'GPU_ONLY'), ('hybrid', 'HYBRID_CPU_GPU'))
CPU_BACKENDS = (('cpu', 'CPU_ONLY'),)
SAID = {'hardware': "the GPU's hardware JPEG decoder", 'cuda': "nvJPEG's CUDA decoder",
        'hybrid': 'its hybrid CPU/GPU decoder', 'cpu': 'its CPU backend (libjpeg-turbo)'}

# libnvjpeg.so.13, or torchvision's libnvjpeg.<hash>.so.13; not libnvjpeg2k (JPEG 2000), nor
# nvImageCodec's own extension libnvjpeg_ext
NVJPEG = re.compile(r'libnvjpeg\.')


def backends_of(device):
    """The (name, BackendKind name) pairs nvImageCodec's decoders are made of on `device`, in the
    order they are asked."""
    return GPU_BACKENDS if device.type == 'cuda' else CPU_BACKENDS


def wheel_cuda_major(names):
    """The CUDA major versions of the nvImageCodec wheels among installed distribution names."""
    return sorted({int(m.group(1)) for m in map(region.WHEEL.match, names) if m})


def installed_names():
    return [d.metadata['Name'] or '' for d in importlib.metadata.distributions()]


def usable(why_not, device, torch_cuda, wheels):
    """Whether nvImageCodec can decode this run's batches on `device` -> (True, None), or (False,
    the reason in a few words). Facts in: why the wheel will not decode (None: it is found, and not
    turned off), the device, torch's CUDA version ('13.0', None on a CPU build), the CUDA majors of
    the installed nvImageCodec wheels. Nothing is imported: the caller imports nvImageCodec when
    this says yes."""
    if why_not is not None:
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


def mapped_nvjpeg(maps):
    """The path of the first libnvjpeg in a /proc/<pid>/maps text, or None. torchvision loads its
    own copy when imported, and the dynamic loader hands that copy (soname libnvjpeg.so.13) to
    nvImageCodec's nvJPEG extension when it asks for the library: the first one mapped is the one
    bound, whatever nvidia-nvjpeg wheel is installed."""
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address, perms, offset, dev, inode, path (may hold spaces)
        if len(fields) == 6 and NVJPEG.match(os.path.basename(fields[5].strip())):
            return fields[5].strip()
    return None


def bound_nvjpeg(maps_path='/proc/self/maps'):
    """mapped_nvjpeg of this process; None where there is no /proc (not Linux)."""
    try:
        with open(maps_path) as f:
            return mapped_nvjpeg(f.read())
    except OSError:
        return None


def first_batch_sentence(version, counts, refused):
    """What a run says once, after nvImageCodec's first batch: which backend decoded how many of its
    images (counts: name -> images, in the order asked), and a word where the GPU's hardware engine
    took none of them, since the CUDA decoder then decodes on the SMs that training needs."""
    took = ', '.join(f'{SAID[name]} {n}' for name, n in counts.items())
    said = (f'nvImageCodec {version} decodes the crops of each batch; of the first batch\'s '
            f'{sum(counts.values()) + refused} images: {took}')
    if refused:
        said += f', torchvision\'s decoder {refused} (nvImageCodec refused them)'
    if counts.get('hardware') == 0:
        said += ('; the hardware JPEG decoder took none (this GPU has none, or it does not decode '
                 'regions)')
    return said


class NvDecoder:
    """nvImageCodec's decoders for one device, made in the thread that decodes (DecodeAhead's, whose
    current device is the run's): on a GPU one per backend, the hardware engine first (backends_of);
    on a CPU device its CPU backend. An image a backend returns None for, or at another size than
    its box (a region ignored), is asked of the next; `counts` says how many images each backend
    decoded. Images come back planar RGB, unrotated (the crop was drawn from the header's size, as
    every other path draws it)."""

    def __init__(self, lib, device, chain=None):
        """lib: the nvidia.nvimgcodec module; chain: [(name, Decoder)] to ask in turn (the tests'
        seam: a decoder that refuses some images), else one Decoder per backend of `device`."""
        self.lib, self.device = lib, device
        n = lib
        self.chain = chain or [(name, self._made(getattr(n.BackendKind, kind)))
                               for name, kind in backends_of(device)]
        self.counts = {name: 0 for name, _ in self.chain}  # images each backend decoded
        self.params = n.DecodeParams(apply_exif_orientation=False, color_spec=n.SRGB,
                                     sample_format=n.P_RGB)

    def _made(self, kind):
        """A Decoder of the one backend `kind`, on this device."""
        n = self.lib
        if self.device.type == 'cuda':
            return region._made_quietly(
                lambda: n.Decoder(device_id=self.device.index, max_num_cpu_threads=4,
                                  backends=[n.Backend(kind)]))
        return region._made_quietly(
            lambda: n.Decoder(device_id=n.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                              backends=[n.Backend(kind)]))

    def __call__(self, chunks, boxes, stream=None):
        """JPEG bytes (uint8 CPU tensors) and their crop boxes -> [uint8 (3, h, w) tensor of the
        crop on the device, or None where no backend could decode it], queued on `stream` (a
        torch.cuda.Stream; None on the CPU)."""
        n = self.lib
        sources = []
        for chunk, (top, left, h, w, _) in zip(chunks, boxes):
            try:
                crop = n.Region(top, left, top + h, left + w)
                sources.append(n.CodeStream(chunk.numpy()).get_sub_code_stream(region=crop))
            except RuntimeError:  # not a stream it parses: decoded by the fallback
                sources.append(None)
        handle = stream.cuda_stream if stream is not None else 0
        out = [None] * len(sources)
        todo = [k for k, s in enumerate(sources) if s is not None]
        for name, decoder in self.chain:
            if not todo:
                break
            images = decoder.decode([sources[k] for k in todo], params=self.params,
                                    cuda_stream=handle)
            for k, image in zip(todo, images):
                out[k] = self._tensor(image, boxes[k])
            refused = [k for k in todo if out[k] is None]
            self.counts[name] += len(todo) - len(refused)
            todo = refused
        return out

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
