"""--decode fast keeps torchvision's augmentation: RandomResizedCrop's area and aspect distributions and a fair
flip, measured from the pixels it outputs, against torchvision's own transforms; the files libjpeg-turbo will
not decode go through PIL; the default path decodes at a reduced DCT scale when the crop allows it.
--decode gpu, driven on CPU through its seam (torchvision's CPU decode_jpeg in place of nvJPEG, the same code
after it): the same crops as the PIL path sample by sample, what nvJPEG refuses decoded on the host, a batch
that crosses worker processes; torchvision's deprecation of its decoders said once, not at every batch. tests/gpu/
runs it with nvJPEG.

The image encodes its own coordinates (red = x, green = y), so each output tells the crop box it came from
and whether it was flipped, whatever code produced it.

Run: python -m pytest -q tests/test_decode.py
"""
import io
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

import dlojz
import dlojz_decode as DD
from conftest import TINY, run_main

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
    real = DD.simplejpeg.decode_jpeg

    def counting(data, *a, min_height=0, **kw):
        scaled.append(min_height < H)
        return real(data, *a, min_height=min_height, **kw)
    monkeypatch.setattr(DD.simplejpeg, 'decode_jpeg', counting)
    fast = DD.FastTrainTransform(S)
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
    fast = DD.FastTrainTransform(S)
    for kind, path in paths.items():
        out = fast(str(path), random.Random('1-0-3'))
        assert out.shape == (3, S, S) and out.dtype == torch.uint8, kind
    with open(paths['png'], 'rb') as f:
        assert f.read(4) == b'\x89PNG'
    bad = tmp_path / 'truncated.JPEG'
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, 'JPEG', quality=90)
    bad.write_bytes(buf.getvalue()[:5000])
    with pytest.raises(DD.BadImageError, match='cannot decode image .*truncated.JPEG'):
        fast(str(bad), random.Random(0))


def test_both_paths_draw_the_same_crops(coords):
    """Same per-sample RNG, same draws: the paths differ by decoder and resampler only (a few levels)."""
    fast, pil = DD.FastTrainTransform(S), DD.TrainTransform(S)
    for i in range(20):
        a, b = fast(str(coords), random.Random(f'3-1-{i}')), pil(str(coords), random.Random(f'3-1-{i}'))
        assert (a.int() - b.int()).abs().float().mean() < 4, i


def test_dct_reduction_by_hand():
    assert DD.dct_reduction(447, 447, 224) == 1 and DD.dct_reduction(448, 448, 224) == 2
    assert DD.dct_reduction(375, 500, 64) == 4 and DD.dct_reduction(512, 600, 64) == 8
    assert DD.dct_reduction(1024, 1024, 64) == 8  # libjpeg-turbo scales down to 1/8 at most


# ------------------------------------------------------------------------------------------ --decode gpu

def gpu_samples(paths, seeds):
    gpu = DD.GpuTrainTransform(S, DD.FastTrainTransform(S))
    return gpu, [(gpu(str(p), random.Random(seed)), 0) for p, seed in zip(paths, seeds)]


def test_gpu_path_draws_the_pil_crops(coords):
    """Sample by sample, the device path's output is the PIL path's with the same seed, up to the resampler
    (measured 0.09 levels mean); another seed's crop is ~10 levels away, so a wrong box or flip fails."""
    seeds = [f'3-1-{i}' for i in range(40)]
    _, samples = gpu_samples([coords] * 40, seeds)
    batch, labels = DD.GpuCollate(S)(samples)
    assert isinstance(batch, DD.EncodedBatch) and batch.pixels.numel() == 0  # all 40 left the worker encoded
    out = batch.to('cpu')
    assert out.shape == (40, 3, S, S) and out.dtype == torch.uint8 and labels.tolist() == [0] * 40
    pil = DD.TrainTransform(S)
    for i, seed in enumerate(seeds):
        assert (out[i].int() - pil(str(coords), random.Random(seed)).int()).abs().float().mean() < 1, i
        assert (out[i].int() - pil(str(coords), random.Random(seeds[i - 1])).int()).abs().float().mean() > 2, i


def quirks(tmp_path):
    """Smooth content, so that the host paths' DCT scaling and the device's full decode agree closely."""
    x, y = np.meshgrid(np.linspace(0, 255, W), np.linspace(0, 255, H))
    rgb = np.stack([x, y, (x + y) / 2], -1).astype(np.uint8)
    paths = [tmp_path / f'{k}.JPEG' for k in ('plain', 'cmyk', 'png', 'gray')]
    Image.fromarray(rgb).save(paths[0], 'JPEG', quality=90)
    Image.fromarray(rgb).convert('CMYK').save(paths[1], 'JPEG', quality=90)
    Image.fromarray(rgb).save(paths[2], 'PNG')
    Image.fromarray(rgb).convert('L').save(paths[3], 'JPEG', quality=90)
    return paths


def test_gpu_path_decodes_what_nvjpeg_refuses_in_the_workers(tmp_path):
    """CMYK and a PNG named .JPEG are decoded by the host path in the worker (same draws) and counted; plain
    and grayscale JPEGs go to the device. The batch crosses a worker process through the DataLoader."""
    paths = quirks(tmp_path)
    gpu = DD.GpuTrainTransform(S, DD.FastTrainTransform(S))

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return len(paths)

        def __getitem__(self, i):
            return gpu(str(paths[i]), random.Random(f'5-0-{i}')), i
    loader = torch.utils.data.DataLoader(Files(), batch_size=4, num_workers=1, collate_fn=DD.GpuCollate(S),
                                         multiprocessing_context='fork')
    (batch, labels), = list(loader)
    assert batch.at == [0, 3] and batch.pixels.shape == (2, 3, S, S) and gpu.in_workers.value == 2
    out = batch.to('cpu')
    fast = DD.FastTrainTransform(S)
    for i, p in enumerate(paths):  # same draws whichever side decoded
        ref = fast(str(p), random.Random(f'5-0-{i}'))
        assert (out[i].int() - ref.int()).abs().float().mean() < 4, p.name
    assert labels.tolist() == [0, 1, 2, 3]


def test_what_the_device_refuses_is_decoded_by_pil(tmp_path, monkeypatch):
    """nvJPEG refusing one image spoils its batch: each image is retried alone and the refused one decoded by
    PIL (counted); a file PIL cannot read either stops with its name, or is replaced with --skip-bad-images."""
    paths = quirks(tmp_path)
    bad = tmp_path / 'truncated.JPEG'
    bad.write_bytes(paths[0].read_bytes()[:3000])
    _, samples = gpu_samples([paths[0], paths[3], paths[0]], ['a', 'b', 'c'])
    batch, _ = DD.GpuCollate(S)(samples)
    want = batch.to('cpu')
    real, gray = DD.DEVICE_DECODE.decode_jpeg, paths[3].read_bytes()

    def refuses_gray(chunk, **kw):
        if bytes(chunk.numpy()) == gray:
            raise RuntimeError('Error while decoding JPEG images: nvjpeg refused it')
        return real(chunk, **kw)
    monkeypatch.setattr(DD.DEVICE_DECODE, 'decode_jpeg', refuses_gray)
    monkeypatch.setattr(DD.DEVICE_DECODE, 'refused', 0)
    got = DD.GpuCollate(S)(samples)[0].to('cpu')
    assert DD.DEVICE_DECODE.refused == 1 and (got.int() - want.int()).abs().max() <= 1

    monkeypatch.setattr(DD.DEVICE_DECODE, 'decode_jpeg', lambda chunk, **kw: (_ for _ in ()).throw(RuntimeError('no')))
    _, samples = gpu_samples([paths[0], bad], ['a', 'b'])
    assert samples[1][0].name == str(bad)  # the header reads: it leaves the worker encoded
    with pytest.raises(DD.BadImageError, match='cannot decode image .*truncated.JPEG'):
        DD.GpuCollate(S)(samples)[0].to('cpu')
    monkeypatch.setattr(DD.DEVICE_DECODE, 'skip_bad_images', True)
    monkeypatch.setattr(DD.DEVICE_DECODE, 'bad', 0)
    batch, _ = DD.GpuCollate(S)([(samples[0][0], 7), (samples[1][0], 3)])
    run = SimpleNamespace(args=SimpleNamespace(non_blocking=False, channels_last=False), device=torch.device('cpu'),
                          norm=(torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)))
    x, y = dlojz.to_device(batch, torch.tensor([7, 3]), run)  # as the training step gets them
    assert DD.DEVICE_DECODE.bad == 1 and torch.equal(x[0], x[1]) and y.tolist() == [7, 7]  # image and label


def test_gpu_decode_is_refused_on_cpu(capsys):
    assert dlojz.cli([*TINY, '--device', 'cpu', '--decode', 'gpu', '--test-nsteps', '1']) == 2
    assert '--decode gpu decodes with nvJPEG on a CUDA GPU and this run is on CPU' in capsys.readouterr().err


def test_a_run_through_the_gpu_path_trains_like_the_pil_path(tmp_path, cache_dir, monkeypatch):
    """The whole loop on the device path's seam (CPU allowed by a patched check): the first step's loss is the
    PIL path's within 0.5 % (same model, inputs that differ by the resampler only; measured 0.2 %; later steps
    drift apart as any two trainings do); the summary counts the host decodes."""
    _, ref = run_main(tmp_path / 'pil', cache_dir, '--test-nsteps', '6', '--log-interval', '1', '--decode', 'pil')
    real = dlojz.check_args

    def allow_cpu(args, device, *a, **kw):
        args.decode = 'pil'
        out = real(args, device, *a, **kw)
        out.decode = 'gpu'
        return out
    monkeypatch.setattr(dlojz, 'check_args', allow_cpu)
    got, records = run_main(tmp_path / 'gpu', cache_dir, '--test-nsteps', '6', '--log-interval', '1',
                            '--decode', 'gpu', '--num-workers', '2')
    assert got['status'] == 'completed' and got['config']['decode'] == 'gpu'
    losses = [r['loss'] for r in records if r['type'] == 'train']
    ref_losses = [r['loss'] for r in ref if r['type'] == 'train']
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[0] == pytest.approx(ref_losses[0], rel=0.005)
    counts = got['data']['gpu_decode']
    assert counts['cpu_after_nvjpeg'] == 0 and 0 <= counts['cpu_in_workers'] <= 48


def test_torchvision_decoder_deprecation_is_said_once(capsys):
    """torchvision 0.29 deprecates decode_jpeg (for TorchCodec, not a dlojz dependency): --decode gpu said so at
    every batch (94 warnings in the test output); now one note per process, and other warnings pass through."""
    import warnings
    dd = DD.DeviceDecode()

    def deprecated(data, **kw):
        warnings.warn('The image decoding and encoding capabilities of TorchVision are deprecated ... TorchCodec',
                      DeprecationWarning)
        warnings.warn('something else', UserWarning)
        return data
    dd.decode_jpeg = deprecated
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert [dd._decode(b'x', torch.device('cpu')) for _ in range(3)] == [b'x'] * 3
    assert [str(w.message) for w in caught] == ['something else'] * 3
    assert capsys.readouterr().err.count('dlojz: note: torchvision deprecates decode_jpeg') == 1
