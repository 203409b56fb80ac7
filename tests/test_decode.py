"""--decode fast keeps torchvision's augmentation: RandomResizedCrop's area and aspect distributions and a fair
flip, measured from the pixels it outputs, against torchvision's own transforms; the files libjpeg-turbo will
not decode go through PIL; the default path decodes at a reduced DCT scale when the crop allows it.
--decode gpu, driven on CPU through its seam (torchvision's CPU decode_jpeg in place of nvJPEG, the same code
after it): the same crops as the PIL path sample by sample, what nvJPEG refuses decoded on the host, a batch
that crosses worker processes; against torchvision 0.19's decode_jpeg (one tensor per call: the floor) it
decodes image by image, and a refusal is printed once; the decoder's two streams for the run, the events the
training stream waits for (torch.cuda faked), the V100 warning, torchvision 0.29's per-call deprecation said
once as a note and no other warning swallowed; the batched geometry against torchvision's resized_crop and its
kernel count; decoding one batch ahead on a thread (order, overlap, errors, a clean stop, same batches).
tests/gpu/ runs it with nvJPEG.

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
from hypothesis import given, settings, strategies as st
from PIL import Image
from torchvision import transforms as T

from conftest import TINY, run_main
import dlojz
from dlojzlib import flags
from dlojzlib.data import decode as DD
from dlojzlib.data import gpu_decode as GD
from dlojzlib.data import resize

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
    gpu = GD.GpuTrainTransform(S, DD.FastTrainTransform(S))
    return gpu, [(gpu(str(p), random.Random(seed)), 0) for p, seed in zip(paths, seeds)]


def test_gpu_path_draws_the_pil_crops(coords):
    """Sample by sample, the device path's output is the PIL path's with the same seed, up to the resampler
    (measured 0.09 levels mean); another seed's crop is ~10 levels away, so a wrong box or flip fails."""
    seeds = [f'3-1-{i}' for i in range(40)]
    _, samples = gpu_samples([coords] * 40, seeds)
    batch, labels = GD.GpuCollate(S)(samples)
    assert isinstance(batch, GD.EncodedBatch) and batch.pixels.numel() == 0  # all 40 left the worker encoded
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
    gpu = GD.GpuTrainTransform(S, DD.FastTrainTransform(S))

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return len(paths)

        def __getitem__(self, i):
            return gpu(str(paths[i]), random.Random(f'5-0-{i}')), i
    loader = torch.utils.data.DataLoader(Files(), batch_size=4, num_workers=1, collate_fn=GD.GpuCollate(S),
                                         multiprocessing_context='fork')
    (batch, labels), = list(loader)
    assert batch.at == [0, 3] and batch.pixels.shape == (2, 3, S, S) and gpu.in_workers.value == 2
    out = batch.to('cpu')
    fast = DD.FastTrainTransform(S)
    for i, p in enumerate(paths):  # same draws whichever side decoded
        ref = fast(str(p), random.Random(f'5-0-{i}'))
        assert (out[i].int() - ref.int()).abs().float().mean() < 4, p.name
    assert labels.tolist() == [0, 1, 2, 3]


# DeviceDecode's nvimgcodec argument where a test is about torchvision's decoder
TORCHVISION = (None, "torchvision's decoder under test")


def test_what_the_device_refuses_is_decoded_by_pil(tmp_path, monkeypatch):
    """nvJPEG refusing one image spoils its batch: each image is retried alone and the refused one decoded by
    PIL (counted); a file PIL cannot read either stops with its name, or is replaced with --skip-bad-images."""
    monkeypatch.setattr(GD.DEVICE_DECODE, 'nvimgcodec', TORCHVISION)
    monkeypatch.setattr(GD.DEVICE_DECODE, '_nv', {})
    paths = quirks(tmp_path)
    bad = tmp_path / 'truncated.JPEG'
    bad.write_bytes(paths[0].read_bytes()[:3000])
    _, samples = gpu_samples([paths[0], paths[3], paths[0]], ['a', 'b', 'c'])
    batch, _ = GD.GpuCollate(S)(samples)
    want = batch.to('cpu')
    real, gray = GD.DEVICE_DECODE.decode_jpeg, paths[3].read_bytes()

    def refuses_gray(chunks, **kw):  # one image or a list (torchvision >= 0.20), refused whole, as nvJPEG's
        if any(bytes(c.numpy()) == gray for c in (chunks if isinstance(chunks, list) else [chunks])):
            raise RuntimeError('Error while decoding JPEG images: nvjpeg refused it')
        return real(chunks, **kw)
    monkeypatch.setattr(GD.DEVICE_DECODE, 'decode_jpeg', refuses_gray)
    monkeypatch.setattr(GD.DEVICE_DECODE, 'refused', 0)
    got = GD.GpuCollate(S)(samples)[0].to('cpu')
    assert GD.DEVICE_DECODE.refused == 1 and (got.int() - want.int()).abs().max() <= 1

    monkeypatch.setattr(GD.DEVICE_DECODE, 'decode_jpeg', lambda chunk, **kw: (_ for _ in ()).throw(RuntimeError('no')))
    _, samples = gpu_samples([paths[0], bad], ['a', 'b'])
    assert samples[1][0].name == str(bad)  # the header reads: it leaves the worker encoded
    with pytest.raises(DD.BadImageError, match='cannot decode image .*truncated.JPEG'):
        GD.GpuCollate(S)(samples)[0].to('cpu')
    monkeypatch.setattr(GD.DEVICE_DECODE, 'skip_bad_images', True)
    monkeypatch.setattr(GD.DEVICE_DECODE, 'bad', 0)
    batch, _ = GD.GpuCollate(S)([(samples[0][0], 7), (samples[1][0], 3)])
    run = SimpleNamespace(args=SimpleNamespace(non_blocking=False, channels_last=False), device=torch.device('cpu'),
                          norm=(torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)))
    x, y = dlojz.to_device(batch, torch.tensor([7, 3]), run)  # as the training step gets them
    assert GD.DEVICE_DECODE.bad == 1 and torch.equal(x[0], x[1]) and y.tolist() == [7, 7]  # image and label


def torchvision_019(real):
    """decode_jpeg as torchvision 0.19 has it: one tensor; a list goes on to torch.ops.image.decode_jpeg_cuda,
    whose schema refuses it (the batched decode_jpegs_cuda op ships in 0.20)."""
    def decode_jpeg(input, mode=None, device='cpu'):
        if not isinstance(input, torch.Tensor):
            raise RuntimeError("image::decode_jpeg_cuda() Expected a value of type 'Tensor' for argument 'data' "
                               "but instead found type 'list'.\nPosition: 0")
        return real(input, mode=mode, device=device)
    return decode_jpeg


def test_decodes_lists_by_torchvision_version():
    assert not GD.decodes_lists('0.19.0') and not GD.decodes_lists('0.19.1+cu121')
    assert GD.decodes_lists('0.20.0') and GD.decodes_lists('0.29.2+cu132') and GD.decodes_lists('1.0.0')


@pytest.mark.parametrize('version', ['0.19.1+cu121', '0.20.0'])
def test_gpu_decode_at_the_torchvision_floor(coords, monkeypatch, capsys, version):
    """Against torchvision 0.19's decode_jpeg (one tensor per call), a decoder that passes it the batch as a
    list (what every torchvision got before: the 0.20 answer here) has every call refused and every image
    decoded by PIL on the host, counted, with the refusal printed once; told the version, it decodes image by
    image and PIL decodes nothing. Either way the images are the PIL path's, seed by seed."""
    seeds = [f'4-2-{i}' for i in range(6)]
    _, samples = gpu_samples([coords] * 6, seeds)
    decoder = GD.DeviceDecode(torchvision_version='0.19.1+cu121', nvimgcodec=TORCHVISION)
    decoder.decode_jpeg = torchvision_019(GD.decode_jpeg)
    decoder.lists = GD.decodes_lists(version)  # the code's belief about the torchvision it runs on
    monkeypatch.setattr(GD, 'DEVICE_DECODE', decoder)
    capsys.readouterr()
    outs = [GD.GpuCollate(S)(samples)[0].to('cpu') for _ in range(2)]  # two batches: one warning
    err = capsys.readouterr().err
    pil = DD.TrainTransform(S)
    for i, seed in enumerate(seeds):
        assert (outs[1][i].int() - pil(str(coords), random.Random(seed)).int()).abs().float().mean() < 1, i
    if version.startswith('0.19'):
        assert decoder.refused == 0 and 'warning' not in err  # (torchvision 0.29's deprecation note may be there)
    else:
        assert decoder.refused == 12  # every image of both batches, on the host
        assert err.count('dlojz: warning: nvJPEG refused') == 1
        assert "Expected a value of type 'Tensor' for argument 'data'" in err and 'cpu_after_nvjpeg' in err


class FakeCudaStreams:
    """torch.cuda's stream and event calls as DeviceDecode and DecodedBatch make them, recorded: a CPU test sees
    which streams exist, which waits are queued (stream on stream, stream on event), which stream each step
    ran on, and which streams are recorded on the batch's images."""

    def __init__(self, capability):
        self.made, self.waits, self.current, self.capability, self.events = [], [], 'main', capability, []
        fake = self

        class Stream:
            def __init__(self, device):
                fake.made.append(self)

            def wait_stream(self, other):
                fake.waits.append((self, other))

            def wait_event(self, event):
                fake.waits.append((self, event))

        class Event:
            def record(self, stream):
                self.stream = stream
                fake.events.append(self)

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.saved, fake.current = fake.current, self.stream

            def __exit__(self, *exc):
                fake.current = self.saved
        self.Stream, self.stream, self.Event = Stream, StreamContext, Event
        self.main = Stream(None)
        self.made.clear()

    def current_stream(self, device=None):
        return self.main if self.current == 'main' else self.current

    def get_device_capability(self, device):
        return self.capability


class Decoded:
    """A decode output: the stream it was written on and the streams recorded as using it."""

    def __init__(self, stream):
        self.stream, self.used_by = stream, []

    def record_stream(self, stream):
        self.used_by.append(stream)


def fake_cuda(monkeypatch, capability):
    """torch.cuda's stream, event and capability calls replaced by a FakeCudaStreams, returned."""
    cuda = FakeCudaStreams(capability)
    for name in ('Stream', 'stream', 'current_stream', 'get_device_capability', 'Event'):
        monkeypatch.setattr(GD.torch.cuda, name, getattr(cuda, name))
    return cuda


def fake_decoder(cuda):
    """A DeviceDecode whose decode_jpeg returns Decoded outputs written on the current fake stream: a list in one
    call from torchvision 0.20, one tensor per call before (the floors' 0.19); both are fine here."""
    decoder = GD.DeviceDecode(nvimgcodec=TORCHVISION)
    decoder.decode_jpeg = lambda data, **kw: [Decoded(cuda.current) for _ in data] if isinstance(data, list) \
        else Decoded(cuda.current)
    return decoder


@pytest.mark.parametrize('capability', [(7, 0), (8, 0), (9, 0)])
def test_device_decode_streams_and_the_sm70_warning(monkeypatch, capsys, capability):
    """On CUDA (torch.cuda faked): two streams of the decoder's own for the whole run, not per call; every decode
    runs on the decode stream, whose outputs the geometry stream waits for and is recorded on (pytorch/vision#9606);
    the crops and resizes run on the geometry stream, which records the batch's event; the training stream
    waits for that event only when it takes the batch, and is recorded on the batch's images; nothing waits on
    the training stream's side. A GPU without a hardware JPEG decoder (sm70, V100) is warned about once."""
    cuda = fake_cuda(monkeypatch, capability)
    recorded = []
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: recorded.append((self, stream)))
    geometry_on = []

    def resized_crops(images, boxes, size):
        geometry_on.append(cuda.current)
        return torch.zeros(len(images), 3, size, size, dtype=torch.uint8)
    monkeypatch.setattr(GD.resize, 'resized_crops', resized_crops)
    decoder = fake_decoder(cuda)
    device = torch.device('cuda', 0)
    outs, batches = [], []
    for k in range(3):
        batch = SimpleNamespace(n=3, at=[0, 1, 2], data=torch.zeros(12, dtype=torch.uint8), sizes=[4] * 3,
                                names=['a', 'b', 'c'], boxes=[(0, 0, 8, 8, False)] * 3, size=S,
                                pixels=torch.empty(0, 3, S, S, dtype=torch.uint8), replaced=[])
        batches.append(decoder.decoded(batch, device))
        assert cuda.current == 'main' and all(w[0] is not cuda.main for w in cuda.waits)  # nothing on main yet
    assert len(cuda.made) == 2 and cuda.main not in cuda.made
    decode, geometry = cuda.made
    calls = 1 if decoder.lists else 3  # decode_jpeg calls per batch: the list, or image by image (0.19)
    assert cuda.waits == [(geometry, decode)] * 3 * calls and geometry_on == [geometry] * 3
    assert [e.stream for e in cuda.events] == [geometry] * 3
    for b in batches:
        outs.append(b.to(device))
    assert cuda.waits[3 * calls:] == [(cuda.main, e) for e in cuda.events]
    assert [(x, stream) for x, stream in recorded] == [(x, cuda.main) for x in outs]
    err = capsys.readouterr().err
    assert err.count('without a hardware JPEG decoder') == (1 if capability == (7, 0) else 0)
    assert GD.lacks_jpeg_engine(capability) == (capability < (8, 0))


def test_decode_outputs_are_written_on_the_decode_stream(monkeypatch):
    """decode_jpeg runs with the decode stream current, its outputs recorded on the geometry stream (their reader)."""
    cuda = fake_cuda(monkeypatch, (9, 0))
    decoder = fake_decoder(cuda)
    streams = decoder._streams_of(torch.device('cuda', 0))
    with cuda.stream(streams['geometry']):
        images = decoder._torchvision([torch.zeros(4, dtype=torch.uint8)] * 2, ['a', 'b'], torch.device('cuda', 0),
                                      streams)
    assert all(img.stream is streams['decode'] and img.used_by == [streams['geometry']] for img in images)


def test_batched_geometry_is_torchvisions_resized_crop_and_flip():
    """resize.resized_crops against torchvision's own resized_crop and hflip (float path, antialiased), image
    by image, crops of different sizes and scales, half flipped: within one level, the mean far below; a box
    off by a few pixels or a wrong flip is several levels away."""
    from torchvision.transforms.v2 import functional as F
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8).float()
              for h, w in [(375, 500), (500, 375), (333, 500), (64, 80), (120, 90), (375, 500)]]
    images = [F.gaussian_blur(x[None], [9, 9], [3.0, 3.0])[0].round().to(torch.uint8) for x in images]  # smooth
    boxes = [(10, 20, 300, 400, False), (0, 0, 500, 375, True), (100, 50, 60, 90, True), (5, 7, 40, 50, False),
             (30, 10, 64, 64, True), (200, 300, 20, 30, False)]
    got = resize.resized_crops(images, boxes, S)
    assert got.shape == (6, 3, S, S) and got.dtype == torch.uint8
    for img, box, out in zip(images, boxes, got):
        t, l, h, w, flip = box
        want = F.resized_crop(img.float(), t, l, h, w, [S, S], antialias=True)
        want = (F.horizontal_flip(want) if flip else want).round().clamp(0, 255)
        diff = (out.float() - want).abs()
        assert diff.max() <= 1 and diff.mean() < 0.05, box
        wrong = F.resized_crop(img.float(), t + 4, l + 4, h, w, [S, S], antialias=True)
        wrong = F.horizontal_flip(wrong) if not flip else wrong
        assert (out.float() - wrong).abs().mean() > 2, box


@given(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 90), st.integers(0, 10 ** 6), st.booleans()),
                min_size=1, max_size=5), st.sampled_from([1, 7, 32]))
@settings(max_examples=40, deadline=None)
def test_any_box_resizes_as_torch_resizes_it(shapes, size):
    """Any image size, box and output size, upsampling and shrinking, 1-pixel crops, images thinner than
    the filter: each output within one level of torch's own float interpolate of the crop (flipped)."""
    images, boxes = [], []
    for h, w, seed, flip in shapes:
        g = torch.Generator().manual_seed(seed)
        images.append(torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8))
        bh, bw = 1 + seed % h, 1 + (seed // 7) % w
        boxes.append(((seed // 3) % (h - bh + 1), (seed // 5) % (w - bw + 1), bh, bw, flip))
    got = resize.resized_crops(images, boxes, size)
    for img, (t, l, h, w, flip), out in zip(images, boxes, got):
        want = torch.nn.functional.interpolate(img[None, :, t:t + h, l:l + w].float(), size=(size, size),
                                               mode='bilinear', antialias=True, align_corners=False)[0]
        want = (want.flip(-1) if flip else want).round().clamp(0, 255)
        assert (out.float() - want).abs().max() <= 1, (img.shape, (t, l, h, w, flip))


def test_batched_geometry_dispatches_as_many_operators_for_4_images_as_for_16():
    """The geometry's operators counted with a dispatch mode (views not counted): the same count for a
    batch of 4 images and one of 16, all of different sizes and flipped, so that Python launches
    nothing per image (crop_resize dispatched two per image: 38 for 16). On CUDA each is a kernel,
    but the nested bmm, which on sm90 launches one GEMM per image from C++ (data/resize.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func._schema.name.startswith(('aten::slice', 'aten::unsqueeze', 'aten::view', 'aten::select',
                                                 'aten::alias', 'aten::lift_fresh', 'aten::detach',
                                                 'aten::_reshape_alias', 'aten::expand')):
                self.ops.append(func._schema.name)
            return out
    counts = []
    for n in (4, 16):
        images = [torch.zeros(3, 50 + k, 60 + 2 * k, dtype=torch.uint8) for k in range(n)]
        with Count() as count:
            resize.resized_crops(images, [(1, 2, 40, 50, True)] * n, S)
        counts.append(len(count.ops))
    assert counts[0] == counts[1] < 120, counts


class Loader:
    """A loader of (batch, labels) items that says when each is drawn."""

    def __init__(self, items, log):
        self.items, self.log = items, log

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        for k, item in enumerate(self.items):
            self.log.append(('drawn', k))
            yield item


class SlowDecoder:
    """decoded() that takes `seconds` of host time (nvJPEG's host work, releasing the GIL as torch's ops do)."""

    def __init__(self, seconds, log, fail_at=None):
        self.seconds, self.log, self.fail_at = seconds, log, fail_at

    def decoded(self, batch, device, non_blocking=False):
        import time
        self.log.append(('decode starts', batch))
        time.sleep(self.seconds)
        if batch == self.fail_at:
            raise DD.BadImageError(f'cannot decode image {batch}.JPEG (truncated); pass --skip-bad-images to skip such files.')
        return SimpleNamespace(images=f'decoded {batch}')


def test_decode_ahead_decodes_the_next_batch_while_a_step_trains():
    """Batch k+1's decode starts before step k ends (the order, from the log), so that with a decode and a step
    of 0.1 s each, 8 steps take ~0.9 s, not the 1.6 s of decoding at each step's start (measured: what a run
    with --no-decode-ahead does); the batches come in the loader's order."""
    import threading
    import time
    log, n, step_s = [], 8, 0.1
    ahead = GD.DecodeAhead(Loader([(k, k) for k in range(n)], log), 'cpu', decoder=SlowDecoder(0.1, log))
    assert len(ahead) == n
    t0, got = time.perf_counter(), []
    for item in ahead:
        got.append(item)
        log.append(('step starts', item[1]))
        time.sleep(step_s)
        log.append(('step ends', item[1]))
    elapsed = time.perf_counter() - t0
    assert [(x.images, y) for x, y in got] == [(f'decoded {k}', k) for k in range(n)]
    for k in range(n - 1):
        assert log.index(('decode starts', k + 1)) < log.index(('step ends', k)), log
    assert elapsed < 0.75 * n * (0.1 + step_s), elapsed
    assert not [t for t in threading.enumerate() if t.name.startswith('dlojz-decode')]


def test_decode_ahead_raises_a_bad_batch_when_it_is_taken_and_stops_cleanly():
    """A decode error reaches the training thread with its sentence when its batch is taken (the batches before it
    trained); leaving the loop early (a stop signal) ends the decode thread, and no later batch is decoded."""
    import threading
    log = []
    ahead = GD.DecodeAhead(Loader([(k, k) for k in range(6)], log), 'cpu', decoder=SlowDecoder(0.01, log, fail_at=3))
    got = []
    with pytest.raises(DD.BadImageError, match='cannot decode image 3.JPEG'):
        for item in ahead:
            got.append(item[1])
    assert got == [0, 1, 2]
    log.clear()
    it = iter(GD.DecodeAhead(Loader([(k, k) for k in range(6)], log), 'cpu', decoder=SlowDecoder(0.01, log)))
    assert next(it)[1] == 0
    it.close()
    assert [e for e in log if e[0] == 'decode starts'] == [('decode starts', 0), ('decode starts', 1)]
    assert not [t for t in threading.enumerate() if t.name.startswith('dlojz-decode')]


def fake_current_gpu(monkeypatch, index):
    """torch.cuda as the decode and DALI threads use it, on a machine without a GPU: GPU `index` is
    current, and set_device resolves its argument as torch's does (an index-less 'cuda' raises
    ValueError). -> the indices set."""
    chosen = []
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: index)
    monkeypatch.setattr(torch.cuda, 'set_device',
                        lambda device: chosen.append(torch.cuda._utils._get_device_index(device)))
    return chosen


def test_decode_ahead_on_a_gpu_given_without_an_index(monkeypatch):
    """DecodeAhead(loader, 'cuda'): the thread's initializer called
    torch.cuda.set_device(torch.device('cuda')), which raises; the pool then failed at the first
    batch (BrokenThreadPool). 'cuda' is the current GPU, 1 here."""
    chosen = fake_current_gpu(monkeypatch, 1)
    log = []
    loader = Loader([(k, k) for k in range(3)], log)
    ahead = GD.DecodeAhead(loader, 'cuda', decoder=SlowDecoder(0.0, log))
    assert [y for _, y in ahead] == [0, 1, 2] and chosen == [1]
    assert ahead.device == torch.device('cuda', 1)


def test_the_gpu_suites_batches_are_built_without_simplejpeg(monkeypatch):
    """tests/gpu builds its nvJPEG batches on the host, and the GPU node lent to this project has no
    simplejpeg: five nvJPEG tests errored there (FastTrainTransform's DataError), hiding what they
    test. The batches are built here with simplejpeg missing, and decoded on the CPU seam."""
    from gpu.test_gpu import encoded_batch
    monkeypatch.setattr(DD, 'simplejpeg', None)
    batch = encoded_batch(6, size=S)
    assert batch.n == 6 and len(batch.at) == 6 and batch.to('cpu').shape == (6, 3, S, S)


def test_decode_ahead_gives_the_batches_decoding_at_the_step_gives(coords):
    """The real decoder on CPU (torchvision's CPU decode_jpeg in place of nvJPEG): through the thread, the same
    images and labels as decoded in the step, batch by batch."""
    batches = []
    for b in range(3):
        _, samples = gpu_samples([coords] * 4, [f'5-{b}-{i}' for i in range(4)])
        batches.append(GD.GpuCollate(S)([(x, b * 10 + i) for i, (x, _) in enumerate(samples)]))
    want = [(x.to('cpu'), y) for x, y in batches]
    got = [(x.to('cpu'), y) for x, y in GD.DecodeAhead(batches, 'cpu')]
    assert len(got) == 3
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)


def test_torchvision_deprecation_warning_silenced_narrowly(coords):
    """torchvision 0.29 warns at every decode_jpeg call; the decoder silences that message and no other."""
    import warnings
    _, samples = gpu_samples([coords] * 2, ['a', 'b'])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        decoder = GD.DeviceDecode(nvimgcodec=TORCHVISION)
        decoder(GD.GpuCollate(S)(samples)[0], torch.device('cpu'))
        warnings.warn('another deprecation', DeprecationWarning)
    assert [str(w.message) for w in seen] == ['another deprecation']


def test_gpu_decode_is_refused_on_cpu(capsys):
    assert dlojz.cli([*TINY, '--device', 'cpu', '--decode', 'gpu', '--test-nsteps', '1']) == 2
    assert '--decode gpu decodes with nvJPEG on a CUDA GPU and this run is on CPU' in capsys.readouterr().err


def test_a_run_through_the_gpu_path_trains_like_the_pil_path(tmp_path, cache_dir, monkeypatch):
    """The whole loop on the device path's seam (CPU allowed by a patched check): the first step's loss is the
    PIL path's within 0.5 % (same model, inputs that differ by the resampler only; measured 0.2 %; later steps
    drift apart as any two trainings do); the summary counts the host decodes."""
    _, ref = run_main(tmp_path / 'pil', cache_dir, '--test-nsteps', '6', '--log-interval', '1', '--decode', 'pil')
    real = flags.check_args

    def allow_cpu(args, device, *a, **kw):
        args.decode = 'pil'
        out = real(args, device, *a, **kw)
        out.decode = 'gpu'
        return out
    monkeypatch.setattr(flags, 'check_args', allow_cpu)
    epochs, real_iter = [], GD.DecodeAhead.__iter__
    monkeypatch.setattr(GD.DecodeAhead, '__iter__', lambda self: epochs.append(self) or real_iter(self))
    got, records = run_main(tmp_path / 'gpu', cache_dir, '--test-nsteps', '6', '--log-interval', '1',
                            '--decode', 'gpu', '--num-workers', '2')
    assert got['status'] == 'completed' and got['config']['decode'] == 'gpu'
    losses = [r['loss'] for r in records if r['type'] == 'train']
    ref_losses = [r['loss'] for r in ref if r['type'] == 'train']
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[0] == pytest.approx(ref_losses[0], rel=0.005)
    assert len(epochs) == 1  # decoded one batch ahead, on the decode thread
    counts = got['data']['gpu_decode']
    assert counts['cpu_after_nvjpeg'] == 0 and 0 <= counts['cpu_in_workers'] <= 48
    assert 'libnvjpeg' in counts
    if counts['decoder'].startswith('nvimgcodec'):  # its CPU backend decoded, and is counted
        backends = counts['nvimgcodec_backends']
        assert set(backends) == {'cpu'} and backends['cpu'] > 0, backends


def test_fake_data_with_gpu_decode_trains_without_a_decoder(tmp_path, cache_dir, monkeypatch):
    """--fake-data has no files to decode: with --decode gpu its in-memory batches go straight to the step
    (before the fix the decode-ahead wrapper took them for encoded batches and the run crashed)."""
    real = flags.check_args

    def allow_cpu(args, device, *a, **kw):
        args.decode = 'pil'
        out = real(args, device, *a, **kw)
        out.decode = 'gpu'
        return out
    monkeypatch.setattr(flags, 'check_args', allow_cpu)
    got, records = run_main(tmp_path / 'fake', cache_dir, '--fake-data', '--fake-train-size', '64',
                            '--test-nsteps', '2', '--log-interval', '1', '--decode', 'gpu')
    assert got['status'] == 'completed' and len([r for r in records if r['type'] == 'train']) == 2


def test_torchvision_decoder_deprecation_is_said_once(capsys):
    """torchvision 0.29 deprecates decode_jpeg (for TorchCodec, not a dlojz dependency): --decode gpu said so at
    every batch (94 warnings in the test output); now one note per process, and other warnings pass through."""
    import warnings
    dd = GD.DeviceDecode()

    def deprecated(data, **kw):
        warnings.warn('The image decoding and encoding capabilities of TorchVision are deprecated ... TorchCodec',
                      DeprecationWarning)
        warnings.warn('something else', UserWarning)
        return data
    dd.decode_jpeg = deprecated
    entered, real = [], warnings.catch_warnings

    def counted(*a, **kw):
        entered.append(1)
        return real(*a, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(GD.warnings, 'catch_warnings', counted)
            assert [dd._decode(b'x', torch.device('cpu')) for _ in range(3)] == [b'x'] * 3
    assert [str(w.message) for w in caught] == ['something else'] * 3
    assert capsys.readouterr().err.count('dlojz: note: torchvision deprecates decode_jpeg') == 1
    # the process's warning state is swapped at the first call only: the decode thread runs beside training
    assert len(entered) == 1


def gray16(path, values):
    """A 16-bit grayscale PNG holding `values` (uint16, 2-D)."""
    Image.fromarray(np.asarray(values, dtype=np.uint16)).save(path)
    return str(path)


def test_a_16_bit_png_keeps_its_levels_on_every_native_path(tmp_path):
    """Issue 40: every native path decoded a 16-bit grayscale PNG as pure white (Pillow's
    convert('RGB') saturates mode I;16). The levels, by hand: 65535 x k / 255 for k = 0..255 along a
    row, each scaled back by 255 / 65535 and rounded, gives k; 32768 (half) gives 128 (127.5 rounded
    half up, as DALI's decoder does). The training transforms (pil, fast), validation, and prepare's
    --max-side re-encoding (a JPEG of the scaled levels) all see a gray ramp, not white."""
    row = np.array([round(65535 * k / 255) for k in range(256)])
    path = gray16(tmp_path / 'ramp.png', np.tile(row, (64, 1)))
    img = np.asarray(DD.load_rgb(path))
    assert img.shape == (64, 256, 3) and (img[0, :, 0] == np.arange(256)).all()
    assert (img[..., 1] == img[..., 0]).all()
    half = np.asarray(DD.load_rgb(gray16(tmp_path / 'half.png', np.full((8, 8), 32768))))
    assert (half == 128).all()
    for transform in (DD.TrainTransform(64), DD.FastTrainTransform(64)):
        x = transform(path, random.Random(0))
        assert x.float().mean() < 200, (type(transform).__name__, x.float().mean())  # white: 255
    val = DD.ValTransform(72, 64)(path)
    assert abs(val.float().mean() - 127.5) < 20, val.float().mean()  # the middle of the ramp
    from dlojzlib.data import shards
    data, ext = shards.encode(path, max_side=32)
    assert ext == 'jpg' and abs(np.asarray(Image.open(io.BytesIO(data))).mean() - 127.5) < 10


def test_floating_point_pixels_are_refused_in_one_sentence(tmp_path):
    path = tmp_path / 'float.tif'
    Image.fromarray(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8), 'F').save(path)
    with pytest.raises(DD.BadImageError,
                       match=r'cannot decode image .*float.tif .*floating-point pixels'):
        DD.load_rgb(str(path))


def test_the_batched_geometry_reads_nothing_back_and_copies_its_numbers_once(monkeypatch):
    """torch.tensor(list, device='cuda') copies from pageable memory and waits for the stream: seven
    such calls per batch made the decode thread wait for the GPU seven times (a review of issue 45).
    The boxes and sizes now go in one table built on the host and moved with one .to(); no
    torch.tensor call names a device. (tests/gpu checks no synchronisation on the GPU itself.)"""
    made, moved = [], []
    real_tensor, real_to = torch.tensor, torch.Tensor.to

    def tensor(*a, **kw):
        made.append(kw.get('device'))
        return real_tensor(*a, **kw)

    def to(self, *a, **kw):
        moved.append(a[0] if a else kw.get('device'))
        return real_to(self, *a, **kw)
    monkeypatch.setattr(resize.torch, 'tensor', tensor)
    monkeypatch.setattr(torch.Tensor, 'to', to)
    images = [torch.zeros(3, 50 + k, 60 + k, dtype=torch.uint8) for k in range(4)]
    resize.resized_crops(images, [(1, 2, 40, 50, True)] * 4, S)
    assert made and all(d is None for d in made), made  # the table, and the nested view's shapes
    assert sum(isinstance(d, (str, torch.device)) for d in moved) == 1, moved  # its one copy
