"""How an image becomes a training tensor: the decode paths (--decode pil, fast, gpu) and the
evaluation transform. Every path draws the same RandomResizedCrop box and flip from the sample's own
RNG (seeded by data.datasets from seed, epoch and index), so they differ by decoder and resampler
only.

- pil: PIL decodes the whole image (TrainTransform).
- fast: libjpeg-turbo decodes the crop's region only (nvImageCodec's CPU backend: rows above and below are
  skipped, columns cut at iMCU boundaries), or the whole file at the smallest DCT scale the crop allows
  (simplejpeg) when that is fewer pixels (FastTrainTransform).
- gpu: the workers read the bytes and draw; the GPU decodes, crops, resizes and flips
  (data.gpu_decode).
"""
import io
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from dlojzlib.data.region import REGION
from dlojzlib.errors import DataError

try:
    import simplejpeg  # libjpeg-turbo with DCT-domain scaling, in a wheel (no system package)
except ImportError:  # --decode fast then says what to install
    simplejpeg = None




class BadImageError(DataError):
    """An image file that cannot be decoded. The message is the sentence shown to the user."""


@dataclass(frozen=True)
class Blob:
    """An image's bytes read from a shard, and the name errors give it (shard:key)."""
    data: bytes
    name: str


def source_name(src):
    return src.name if isinstance(src, Blob) else src


def read_bytes(src):
    """The encoded image of a path or a Blob."""
    if isinstance(src, Blob):
        return src.data
    try:
        with open(src, 'rb') as f:
            return f.read()
    except OSError as e:
        raise BadImageError(f'cannot read image {src} ({e.strerror}); check the data directory.') from None


HIGH_BIT_GRAY = ('I;16', 'I;16B', 'I;16L', 'I;16N', 'I')  # Pillow's 16-bit gray (Pillow < 11: 'I')


def to_rgb(img):
    """An opened image as 8-bit RGB. 16-bit gray (a PNG's 'I;16', or 'I' holding 0..65535) is scaled
    by 255 / 65535 and rounded, as DALI's decoder does; Pillow's convert('RGB') saturates it
    instead (everything above 255 turns white). 48-bit RGB PNGs Pillow already opens as 8-bit RGB
    (the high bytes: at most one level below DALI's rounding). Floating-point pixels have no range
    to scale from: refused (ValueError)."""
    if img.mode in HIGH_BIT_GRAY:
        a = np.clip(np.asarray(img).astype(np.int64), 0, 65535)
        return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), 'L').convert('RGB')
    if img.mode == 'F':
        raise ValueError('floating-point pixels (mode F) have no range to scale to 8 bits; '
                         'convert the file to an 8- or 16-bit PNG or a JPEG')
    return img.convert('RGB')


def load_rgb(src):
    """Decode any image real ImageNet holds (a path or a Blob) into RGB; raise BadImageError naming
    the file otherwise."""
    name = source_name(src)
    try:
        with (io.BytesIO(src.data) if isinstance(src, Blob) else open(src, 'rb')) as f:
            img = Image.open(f)
            img.load()  # force the decode here so a truncated file fails now, with its name
            return to_rgb(img)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError... depending on the damage
        raise BadImageError(f'cannot decode image {name} ({type(e).__name__}: {e}); remove or replace it, '
                            f'or pass --skip-bad-images to replace bad files and count them.') from None


def too_large(width, height):
    """Whether PIL refuses an image of this size (more than 2 x Image.MAX_IMAGE_PIXELS pixels,
    179 M by default: a decompression bomb), as validation and --decode pil do: --decode fast and
    the GPU path read the size from the header and hand such a file to PIL, which says so, so that
    training and validation accept the same images."""
    limit = Image.MAX_IMAGE_PIXELS
    return limit is not None and width * height > 2 * limit


def sample_rng(seed, epoch, index):
    """The RNG a training sample's augmentation draws from: (seed, epoch, index) alone, so that a
    batch is the same whatever the workers, the loader (native or DALI) or a resume. str seeds hash
    deterministically (sha512)."""
    return random.Random(f'{seed}-{epoch}-{index}')


def random_resized_crop_params(rng, width, height, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params algorithm, drawing from a local RNG
    (random.Random)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: central crop at the closest allowed ratio
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def host_train_transform(size):
    """The training transform that decodes on the host: --decode fast where simplejpeg is installed,
    else --decode pil (a cluster module may lack simplejpeg)."""
    return (FastTrainTransform if simplejpeg is not None else TrainTransform)(size)


class TrainTransform:
    """--decode pil: decode the whole image with PIL, then RandomResizedCrop + horizontal flip ->
    uint8 CHW tensor (normalised later, on the device)."""
    decode = 'pil'

    def __init__(self, size):
        self.size = size

    def __call__(self, path, rng):
        img = load_rgb(path)
        top, left, h, w = random_resized_crop_params(rng, img.width, img.height)
        img = TF.resized_crop(img, top, left, h, w, [self.size, self.size],
                              interpolation=InterpolationMode.BILINEAR, antialias=True)
        if rng.random() < 0.5:
            img = TF.hflip(img)
        return TF.pil_to_tensor(img)


def dct_reduction(h, w, size, most=8):
    """The largest r in 1, 2, 4, 8 such that an h x w crop decoded at 1/r scale still has `size`
    pixels on each side: libjpeg-turbo then scales in the DCT domain (SIMD IDCTs at these factors),
    decoding r^2 times fewer pixels and losing no detail the output keeps."""
    r = 1
    while r < most and h // (2 * r) >= size and w // (2 * r) >= size:
        r *= 2
    return r


class FastTrainTransform:
    """--decode fast: the same RandomResizedCrop + flip, same draws from the same per-sample RNG,
    decoding no more pixels than the crop needs: the crop is drawn from the JPEG header's size;
    libjpeg-turbo decodes the crop's region alone (RegionDecoder), or, when that is more pixels, the
    whole file at the smallest power-of-two DCT scale that keeps the crop at least `size` pixels
    wide (simplejpeg); torch resizes the crop in uint8 (bilinear, antialiased, as torchvision's).
    Files libjpeg-turbo will not decode to RGB (CMYK, a PNG named .JPEG, ...) go through PIL, same
    draws."""
    decode = 'fast'

    def __init__(self, size):
        if simplejpeg is None:
            raise DataError('--decode fast needs the simplejpeg package (pip install -r requirements.txt); '
                            'install it or pass --decode pil.')
        self.size = size

    def __call__(self, path, rng):
        data = read_bytes(path)
        try:
            height, width, colorspace = simplejpeg.decode_jpeg_header(data)[:3]
        except ValueError:  # not a JPEG libjpeg-turbo reads
            return self._with_pil(path, rng)
        if too_large(width, height):  # PIL refuses it, with validation's sentence
            return self._with_pil(path, rng)
        top, left, h, w = random_resized_crop_params(rng, width, height)
        r = dct_reduction(h, w, self.size)
        # A file that does not end with its EOI marker (FF D9) is decoded whole: a truncated file
        # must fail whatever its crop (a region above the cut would decode), as the other paths make
        # it fail.
        if REGION.why_not is None and colorspace in ('YCbCr', 'Gray') \
                and h * w * r * r <= height * width and data.endswith(b'\xff\xd9'):
            crop = REGION(data, top, left, h, w)  # the region's pixels, fewer than the scaled whole file's
            if crop is not None:
                REGION.count(0)
                return self._finish(crop, w, h, 0, 0, h, w, rng)  # the crop is the whole array
        try:
            arr = simplejpeg.decode_jpeg(data, 'RGB', min_height=-(-height // r), min_width=-(-width // r))
        except ValueError:  # CMYK to RGB, a damaged file: PIL says which
            REGION.count(2)
            img = load_rgb(path)
            return self._finish(np.asarray(img), width, height, top, left, h, w, rng)
        REGION.count(1)
        return self._finish(arr, width, height, top, left, h, w, rng)

    def _with_pil(self, path, rng):
        REGION.count(2)
        img = load_rgb(path)
        top, left, h, w = random_resized_crop_params(rng, img.width, img.height)
        return self._finish(np.asarray(img), img.width, img.height, top, left, h, w, rng)

    def _finish(self, arr, width, height, top, left, h, w, rng):
        sy, sx = arr.shape[0] / height, arr.shape[1] / width  # 1/r, or 1 for a full decode
        t, l = int(top * sy), int(left * sx)
        crop = arr[t:t + max(1, round(h * sy)), l:l + max(1, round(w * sx))]
        x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).unsqueeze(0)
        x = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode='bilinear', antialias=True,
                                            align_corners=False)[0]
        if rng.random() < 0.5:
            x = x.flip(-1)
        return x.contiguous()


class ValTransform:
    """Resize the shorter side to `resize`, center crop `size` (torchvision's ImageNet evaluation)."""

    def __init__(self, resize, size):
        self.resize, self.size = resize, size

    def __call__(self, path, rng=None):
        img = TF.resize(load_rgb(path), self.resize, interpolation=InterpolationMode.BILINEAR, antialias=True)
        return TF.pil_to_tensor(TF.center_crop(img, self.size))
