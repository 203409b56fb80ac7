"""--decode gpu through nvImageCodec, on this machine through the same API's CPU backend (issue 45):

- the decoded crops are --decode fast's region decodes, bit for bit, and the batch out of the device
  path (regions, batched resize, flips) is --decode fast's samples, seed by seed, within one level (the
  resize is torch's float kernel, --decode fast's its uint8 kernel, which rounds between its passes);
- which decoder a run gets, from the facts (the module, the device, torch's CUDA, the wheels), and
  torchvision's decode_jpeg as the fallback, said once with the reason: nvImageCodec missing, of
  another CUDA, decoding nothing of the first batch, or refusing one image (then decoded by
  torchvision's, counted);
- on CUDA (torch.cuda faked) nvImageCodec decodes on the decode stream it is handed, and its outputs
  are copied into torch's memory there before the geometry stream reads them.

Run: python -m pytest -q tests/test_nvdecode.py"""
import io
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from dlojzlib.data import decode as DD
from dlojzlib.data import gpu_decode as GD
from dlojzlib.data import nvdecode, region

S = 64
NV = region._import_nvimgcodec()
needs_nvimgcodec = pytest.mark.skipif(NV[0] is None, reason=f'nvImageCodec: {NV[1]}')


@pytest.fixture(scope='module')
def photos(tmp_path_factory):
    """Three 500 x 375 JPEGs of mixed content (smooth ramps and noise), 4:2:0 as cameras write them."""
    folder = tmp_path_factory.mktemp('photos')
    rng = np.random.default_rng(0)
    x, y = np.meshgrid(np.linspace(0, 255, 500), np.linspace(0, 255, 375))
    paths = []
    for k in range(3):
        noise = rng.normal(0, 20 + 20 * k, (375, 500, 3))
        img = np.clip(np.stack([x, y, (x + y) / 2], -1) + noise, 0, 255).astype(np.uint8)
        paths.append(folder / f'photo{k}.JPEG')
        Image.fromarray(img).save(paths[-1], 'JPEG', quality=90)
    return paths


def encoded(paths, seeds):
    gpu = GD.GpuTrainTransform(S, DD.FastTrainTransform(S))
    samples = [(gpu(str(paths[i % len(paths)]), random.Random(seed)), 0) for i, seed in enumerate(seeds)]
    return GD.GpuCollate(S)(samples)[0]


@needs_nvimgcodec
def test_the_crops_nvimgcodec_decodes_are_the_region_decoders(photos):
    """The same libjpeg-turbo decodes the same region: nvImageCodec's batched call gives, crop by crop, the
    pixels --decode fast's region decoder gives one at a time."""
    batch = encoded(photos, [f'1-0-{i}' for i in range(12)])
    chunks = list(torch.split(batch.data, batch.sizes))
    crops = nvdecode.NvDecoder(NV[0], torch.device('cpu'))(chunks, batch.boxes)
    for chunk, (t, l, h, w, _), crop in zip(chunks, batch.boxes, crops):
        want = DD.REGION(chunk.numpy().tobytes(), t, l, h, w)
        assert crop.shape == (3, h, w) and torch.equal(crop, torch.from_numpy(want).permute(2, 0, 1))


@needs_nvimgcodec
def test_the_device_path_gives_fast_decodes_samples(photos, monkeypatch, capsys):
    """A batch through the device path on the CPU backend (one decode call, the batched resize, the
    flips) against --decode fast sample by sample, same seeds, its region decode forced (the DCT-scaled
    whole file is another decode): within one level everywhere, and another seed's sample is far."""
    monkeypatch.setattr(DD, 'dct_reduction', lambda h, w, size, most=8: 1)
    seeds = [f'2-0-{i}' for i in range(24)]
    decoder = GD.DeviceDecode()
    out = decoder(encoded(photos, seeds), torch.device('cpu'))
    assert decoder.decoder == f'nvimgcodec {NV[0].__version__}' and decoder.nv_refused == 0
    assert 'dlojz: --decode gpu: nvImageCodec' in capsys.readouterr().err
    fast = DD.FastTrainTransform(S)
    for i, seed in enumerate(seeds):
        want = fast(str(photos[i % 3]), random.Random(seed))
        diff = (out[i].int() - want.int()).abs()
        assert diff.max() <= 1 and diff.float().mean() < 0.2, (i, diff.max(), diff.float().mean())
        other = fast(str(photos[i % 3]), random.Random(seeds[i - 1]))
        assert (out[i].int() - other.int()).abs().float().mean() > 5, i


@pytest.mark.parametrize('facts, ok, words', [
    ((None, 'nvidia-nvimgcodec-cu12 is not installed', 'cuda', '13.0', []), False, 'is not installed'),
    (('lib', None, 'cpu', None, [12]), True, None),
    (('lib', None, 'cuda', '13.0', [12]), False,
     'torch is built for CUDA 13.0 and nvidia-nvimgcodec-cu12 is installed; pip install nvidia-nvimgcodec-cu13 '
     'nvidia-nvjpeg for its GPU decoders'),
    (('lib', None, 'cuda', '12.6', [12]), True, None),
    (('lib', None, 'cuda', '12.8', []), False, 'no wheel is installed; pip install nvidia-nvimgcodec-cu12 '
                                               'nvidia-nvjpeg-cu12'),
    (('lib', None, 'cuda', '13.0', [12, 13]), True, None),
])
def test_which_decoder_from_the_facts(facts, ok, words):
    lib, why, device, cuda, wheels = facts
    got_ok, got_why = nvdecode.usable(lib, why, torch.device(device), cuda, wheels)
    assert got_ok == ok and (got_why == words if words is None else words in got_why)


def test_the_wheels_cuda_major_comes_from_their_names():
    assert nvdecode.wheel_cuda_major(['numpy', 'nvidia-nvimgcodec-cu12', 'nvidia-nvjpeg-cu12']) == [12]
    assert nvdecode.wheel_cuda_major(['nvidia-nvimgcodec-cu13', 'nvidia-nvimgcodec-cu12']) == [12, 13]
    assert nvdecode.wheel_cuda_major(['nvidia-nvimgcodec', 'nvidia-nvimgcodec-cu1x']) == []


class Refusing:
    """An NvDecoder that gives what `real` gives, but None at the positions in `refuse` (or everywhere)."""

    def __init__(self, real, refuse):
        self.real, self.refuse, self.calls = real, refuse, []

    def __call__(self, chunks, boxes, stream=None):
        self.calls.append(stream)
        got = self.real(chunks, boxes, stream)
        return [None if self.refuse == 'all' or k in self.refuse else x for k, x in enumerate(got)]


@needs_nvimgcodec
def test_what_nvimgcodec_refuses_torchvision_decodes(photos, monkeypatch, capsys):
    """An image nvImageCodec refuses is decoded by torchvision's decoder (counted), in its place: the batch
    is the one nvImageCodec alone gives, within the one level of torchvision's own libjpeg-turbo decode."""
    seeds = [f'3-0-{i}' for i in range(6)]
    want = GD.DeviceDecode()(encoded(photos, seeds), torch.device('cpu'))
    decoder = GD.DeviceDecode()
    cpu = torch.device('cpu')
    decoder._nv[cpu] = Refusing(nvdecode.NvDecoder(NV[0], cpu), {1, 4})
    decoder.decoder = 'nvimgcodec (refusing)'
    got = decoder(encoded(photos, seeds), cpu)
    assert decoder.nv_refused == 2 and decoder.refused == 0
    assert (got.int() - want.int()).abs().max() <= 1


@needs_nvimgcodec
def test_a_decoder_that_decodes_nothing_of_the_first_batch_gives_way_to_torchvision(photos, capsys):
    """nvImageCodec without its GPU extension (the nvJPEG wheel missing) returns None for every image: from
    the first batch on, torchvision's decoder decodes, said once with the reason, and summary.json's
    decoder says so."""
    cpu = torch.device('cpu')
    decoder = GD.DeviceDecode()
    decoder._nv[cpu] = Refusing(nvdecode.NvDecoder(NV[0], cpu), 'all')
    for k in range(2):
        out = decoder(encoded(photos, [f'4-{k}-{i}' for i in range(4)]), cpu)
        assert out.shape == (4, 3, S, S)
    assert decoder._nv[cpu] is None and decoder.decoder.startswith('torchvision ')
    assert 'decoded none of the first batch' in decoder.why_not
    err = capsys.readouterr().err
    assert err.count("dlojz: --decode gpu: torchvision's decode_jpeg decodes whole images") == 1


def test_without_nvimgcodec_torchvision_decodes_and_says_why(photos, capsys):
    decoder = GD.DeviceDecode(nvimgcodec=(None, 'nvidia-nvimgcodec-cu12 is not installed (pip install -r '
                                                'requirements.txt)'))
    out = decoder(encoded(photos, ['5-0-0', '5-0-1']), torch.device('cpu'))
    assert out.shape == (2, 3, S, S) and decoder.decoder.startswith('torchvision ')
    err = capsys.readouterr().err
    assert "torchvision's decode_jpeg decodes whole images (nvJPEG's CUDA decoder): nvidia-nvimgcodec-cu12 " \
           "is not installed" in err


def test_on_cuda_nvimgcodec_decodes_on_the_decode_stream_and_torch_owns_the_copy(monkeypatch):
    """torch.cuda faked: nvImageCodec is called with the decode stream current and handed it (its
    cuda_stream); its outputs are copied into one torch allocation while the decode stream is still
    current (its buffers are freed in its own stream order); the geometry stream waits for the decode
    stream and is recorded on that copy, then resizes."""
    from test_decode import fake_cuda
    cuda = fake_cuda(monkeypatch, (9, 0))
    seen = {}
    real_cat = torch.cat

    def cat(tensors, *a, **kw):
        seen.setdefault('cat_on', []).append(cuda.current)
        return real_cat(tensors, *a, **kw)
    monkeypatch.setattr(GD.torch, 'cat', cat)
    recorded = []
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: recorded.append(stream))

    def nv(chunks, boxes, stream=None):
        seen['nv'] = (stream, cuda.current)
        return [torch.zeros(3, b[2], b[3], dtype=torch.uint8) for b in boxes]

    def resized_crops(images, boxes, size):
        seen['geometry_on'] = cuda.current
        return torch.zeros(len(images), 3, size, size, dtype=torch.uint8)
    monkeypatch.setattr(GD.resize, 'resized_crops', resized_crops)
    device = torch.device('cuda', 0)
    decoder = GD.DeviceDecode()
    decoder._nv[device] = nv
    decoder.decoder = 'nvimgcodec (fake)'
    batch = SimpleNamespace(n=2, at=[0, 1], data=torch.zeros(8, dtype=torch.uint8), sizes=[4, 4], names=['a', 'b'],
                            boxes=[(0, 0, 8, 6, False), (1, 1, 5, 7, True)], size=S,
                            pixels=torch.empty(0, 3, S, S, dtype=torch.uint8), replaced=[])
    decoder.decoded(batch, device)
    decode, geometry = cuda.made
    assert seen['nv'] == (decode, decode) and seen['cat_on'][0] is decode
    assert (geometry, decode) in cuda.waits and recorded[:2] == [geometry, geometry]
    assert seen['geometry_on'] is geometry


@needs_nvimgcodec
def test_an_image_of_another_layout_or_size_is_taken_as_it_is_or_left_to_the_fallback(photos):
    """A backend that gives the crop interleaved (H, W, 3) where planar was asked is read as planar; one
    whose size is not the box's is left to the fallback (None), never resized as if it were the crop."""
    nv = nvdecode.NvDecoder(NV[0], torch.device('cpu'))
    planar = torch.arange(3 * 4 * 5, dtype=torch.uint8).view(3, 4, 5)

    class Host:
        def __init__(self, array):
            self.array = array

        def cpu(self):
            return self.array
    got = nv._tensor(Host(planar.permute(1, 2, 0).numpy()), (0, 0, 4, 5, False))
    assert torch.equal(got, planar)
    assert nv._tensor(Host(planar.numpy()), (0, 0, 4, 5, False)) is not None
    assert nv._tensor(Host(planar.numpy()), (0, 0, 5, 4, False)) is None


class RefusingFrom(Refusing):
    """Refuses every image of the batches from the `first`-th call on (0-based)."""

    def __init__(self, real, first):
        super().__init__(real, set())
        self.first = first

    def __call__(self, chunks, boxes, stream=None):
        self.refuse = 'all' if len(self.calls) >= self.first else set()
        return super().__call__(chunks, boxes, stream)


@needs_nvimgcodec
def test_a_later_batch_nvimgcodec_refuses_whole_does_not_turn_it_off(photos, capsys):
    """nvImageCodec gives way to torchvision's decoder only when it has decoded nothing on the device
    yet: a later batch it refuses whole (one image, a small last batch of bad files) goes to torchvision's
    decoder, counted, and the next batch is nvImageCodec's again (a review of issue 45 found one such
    batch turned it off for the rest of the run, saying 'none of the first batch')."""
    cpu = torch.device('cpu')
    decoder = GD.DeviceDecode()
    decoder._nv[cpu] = RefusingFrom(nvdecode.NvDecoder(NV[0], cpu), 1)
    decoder.decoder = 'nvimgcodec (refusing from the second batch)'
    for k in range(3):
        decoder(encoded(photos, [f'6-{k}-0']), cpu)
    assert decoder._nv[cpu] is not None and len(decoder._nv[cpu].calls) == 3
    assert decoder.nv_refused == 2 and 'decoded none' not in capsys.readouterr().err
