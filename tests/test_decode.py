"""--decode fast keeps torchvision's augmentation: RandomResizedCrop's area and aspect distributions and a fair
flip, measured from the pixels it outputs, against torchvision's own transforms; the files libjpeg-turbo will
not decode go through PIL; the default path decodes at a reduced DCT scale when the crop allows it.

The image encodes its own coordinates (red = x, green = y), so each output tells the crop box it came from
and whether it was flipped, whatever code produced it.

Run: python -m pytest -q tests/test_decode.py
"""
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

import dlojz_data as D

W, H, S, N = 500, 375, 64, 1500  # an ImageNet-sized JPEG, 64 px crops (DCT scaling applies), samples per path
KS_CRIT = 1.95 * (2 / N) ** 0.5  # two-sample Kolmogorov-Smirnov, alpha = 0.001


@pytest.fixture(scope='module')
def coords(tmp_path_factory):
    x = np.round(np.linspace(0, 255, W))[None, :].repeat(H, 0)
    y = np.round(np.linspace(0, 255, H))[:, None].repeat(W, 1)
    img = np.stack([x, y, np.full_like(x, 128)], -1).astype(np.uint8)
    path = tmp_path_factory.mktemp('coords') / 'coords.JPEG'
    Image.fromarray(img).save(path, quality=95)
    return path


def crop_box(out):
    """(area fraction, aspect w/h, flipped) of the crop an output (3, S, S uint8) came from. The outermost
    output pixels sit half an output pixel inside the crop: the span they show is (S - 1) / S of it."""
    r, g = out[0].double(), out[1].double()
    x0, x1 = r[:, 0].mean() / 255 * (W - 1), r[:, -1].mean() / 255 * (W - 1)
    y0, y1 = g[0].mean() / 255 * (H - 1), g[-1].mean() / 255 * (H - 1)
    w, h = abs(x1 - x0) * S / (S - 1), abs(y1 - y0) * S / (S - 1)
    return float(w * h / (W * H)), float(w / h), bool(x1 < x0)


def ks(a, b):
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.max(np.abs(np.searchsorted(a, grid, 'right') / len(a) - np.searchsorted(b, grid, 'right') / len(b))))


def boxes(fn):
    area, aspect, flips = zip(*(crop_box(fn(i)) for i in range(N)))
    return np.array(area), np.log(np.array(aspect)), np.array(flips)


def torchvision_boxes(coords, scale=(0.08, 1.0)):
    tv = T.Compose([T.RandomResizedCrop(S, scale=scale, antialias=True), T.RandomHorizontalFlip(), T.PILToTensor()])
    img = Image.open(coords).convert('RGB')
    torch.manual_seed(0)
    return boxes(lambda i: tv(img))


def test_fast_decode_keeps_randomresizedcrop_and_flip(coords, monkeypatch):
    scaled = []
    real = D.simplejpeg.decode_jpeg

    def counting(data, *a, min_height=0, **kw):
        scaled.append(min_height < H)
        return real(data, *a, min_height=min_height, **kw)
    monkeypatch.setattr(D.simplejpeg, 'decode_jpeg', counting)
    fast = D.FastTrainTransform(S)
    area, log_aspect, flips = boxes(lambda i: fast(str(coords), random.Random(f'7-0-{i}')))
    ref_area, ref_log_aspect, ref_flips = torchvision_boxes(coords)
    print(f'KS area {ks(area, ref_area):.4f}, log aspect {ks(log_aspect, ref_log_aspect):.4f} (critical '
          f'{KS_CRIT:.4f}); flips {flips.mean():.3f} vs {ref_flips.mean():.3f}; scaled decodes {np.mean(scaled):.2f}')
    assert ks(area, ref_area) < KS_CRIT and ks(log_aspect, ref_log_aspect) < KS_CRIT
    sigma = (0.25 / N) ** 0.5
    assert abs(flips.mean() - 0.5) < 4 * sigma and abs(ref_flips.mean() - 0.5) < 4 * sigma
    assert np.mean(scaled) > 0.5  # most 64 px crops of a 500 x 375 image decode at 1/2 scale or less
    # the ranges: RandomResizedCrop's scale and ratio bounds, up to the coordinate read-out's error
    assert 0.07 < area.min() and area.max() < 1.02 and abs(log_aspect).max() < np.log(4 / 3) + 0.03


def test_the_check_catches_another_distribution(coords):
    """The same statistics tell torchvision's crops from crops of scale (0.25, 1): the test above can fail."""
    area, log_aspect, _ = torchvision_boxes(coords)
    other_area, _, _ = torchvision_boxes(coords, scale=(0.25, 1.0))
    assert ks(area, other_area) > 2 * KS_CRIT


def test_files_libjpeg_turbo_refuses_go_through_pil(tmp_path):
    """CMYK JPEG and a PNG named .JPEG decode, with the same crop draws as a plain JPEG of the same size."""
    rgb = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
    paths = {'cmyk': tmp_path / 'cmyk.JPEG', 'png': tmp_path / 'png.JPEG', 'gray': tmp_path / 'gray.JPEG'}
    Image.fromarray(rgb).convert('CMYK').save(paths['cmyk'], 'JPEG', quality=90)
    Image.fromarray(rgb).save(paths['png'], 'PNG')
    Image.fromarray(rgb).convert('L').save(paths['gray'], 'JPEG', quality=90)
    fast = D.FastTrainTransform(S)
    for kind, path in paths.items():
        out = fast(str(path), random.Random('1-0-3'))
        assert out.shape == (3, S, S) and out.dtype == torch.uint8, kind
    with open(paths['png'], 'rb') as f:
        assert f.read(4) == b'\x89PNG'
    bad = tmp_path / 'truncated.JPEG'
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, 'JPEG', quality=90)
    bad.write_bytes(buf.getvalue()[:5000])
    with pytest.raises(D.BadImageError, match='cannot decode image .*truncated.JPEG'):
        fast(str(bad), random.Random(0))


def test_both_paths_draw_the_same_crops(coords):
    """Same per-sample RNG, same draws: the paths differ by decoder and resampler only (a few levels)."""
    fast, pil = D.FastTrainTransform(S), D.TrainTransform(S)
    for i in range(20):
        a, b = fast(str(coords), random.Random(f'3-1-{i}')), pil(str(coords), random.Random(f'3-1-{i}'))
        assert (a.int() - b.int()).abs().float().mean() < 4, i


def test_dct_reduction_by_hand():
    assert D.dct_reduction(447, 447, 224) == 1 and D.dct_reduction(448, 448, 224) == 2
    assert D.dct_reduction(375, 500, 64) == 4 and D.dct_reduction(512, 600, 64) == 8
    assert D.dct_reduction(1024, 1024, 64) == 8  # libjpeg-turbo scales down to 1/8 at most
