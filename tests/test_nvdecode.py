"""--decode gpu through nvImageCodec, on this machine through the same API's CPU backend (issue 45):

- the decoded crops are --decode fast's region decodes, bit for bit, and the batch out of the device
  path (regions, batched resize, flips) is --decode fast's samples, seed by seed, within one level (the
  resize is torch's float kernel, --decode fast's its uint8 kernel, which rounds between its passes);
- which decoder a run gets, from the facts (the module, the device, torch's CUDA, the wheels), and
  torchvision's decode_jpeg as the fallback, said once with the reason: nvImageCodec missing, of
  another CUDA, decoding nothing of the first batch, or refusing one image (then decoded by
  torchvision's, counted);
- on CUDA (torch.cuda faked) nvImageCodec decodes on the decode stream it is handed, and its outputs
  are copied into torch's memory there before the geometry stream reads them;
- which backend decoded how many images (gpu review 5, F6): each backend is a decoder of its own,
  asked in turn for what those before it refused, one call each per batch; the counts reach
  summary.json's record and the line the run prints after its first batch, which says so when the
  hardware engine took none; the libnvjpeg the process bound is read from /proc/self/maps.

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
WHY_NOT = region.why_not_nvimgcodec()
NV = region.import_nvimgcodec() if WHY_NOT is None else None  # the module, for the CPU seam
needs_nvimgcodec = pytest.mark.skipif(NV is None, reason=f'nvImageCodec: {WHY_NOT}')


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
    crops = nvdecode.NvDecoder(NV, torch.device('cpu'))(chunks, batch.boxes)
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
    assert decoder.decoder == f'nvimgcodec {region.nvimgcodec_version()}'
    assert decoder.nv_refused == 0
    assert decoder.record()['nvimgcodec_backends'] == {'cpu': 24}
    assert capsys.readouterr().err.count('dlojz: --decode gpu: nvImageCodec') == 1
    fast = DD.FastTrainTransform(S)
    for i, seed in enumerate(seeds):
        want = fast(str(photos[i % 3]), random.Random(seed))
        diff = (out[i].int() - want.int()).abs()
        assert diff.max() <= 1 and diff.float().mean() < 0.2, (i, diff.max(), diff.float().mean())
        other = fast(str(photos[i % 3]), random.Random(seeds[i - 1]))
        assert (out[i].int() - other.int()).abs().float().mean() > 5, i


@pytest.mark.parametrize('facts, ok, words', [
    (('nvidia-nvimgcodec-cu12 is not installed', 'cuda', '13.0', []), False, 'is not installed'),
    (('turned off by DLOJZ_REGION_DECODE=0', 'cuda', '13.0', [13]), False, 'DLOJZ_REGION_DECODE=0'),
    ((None, 'cpu', None, [12]), True, None),
    ((None, 'cuda', '13.0', [12]), False,
     'torch is built for CUDA 13.0 and nvidia-nvimgcodec-cu12 is installed; pip install nvidia-nvimgcodec-cu13 '
     'nvidia-nvjpeg for its GPU decoders'),
    ((None, 'cuda', '12.6', [12]), True, None),
    ((None, 'cuda', '12.8', []), False, 'no wheel is installed; pip install nvidia-nvimgcodec-cu12 '
                                        'nvidia-nvjpeg-cu12'),
    ((None, 'cuda', '13.0', [12, 13]), True, None),
])
def test_which_decoder_from_the_facts(facts, ok, words):
    why, device, cuda, wheels = facts
    got_ok, got_why = nvdecode.usable(why, torch.device(device), cuda, wheels)
    assert got_ok == ok and (got_why == words if words is None else words in got_why)


def test_the_wheels_cuda_major_comes_from_their_names():
    assert nvdecode.wheel_cuda_major(['numpy', 'nvidia-nvimgcodec-cu12', 'nvidia-nvjpeg-cu12']) == [12]
    assert nvdecode.wheel_cuda_major(['nvidia-nvimgcodec-cu13', 'nvidia-nvimgcodec-cu12']) == [12, 13]
    assert nvdecode.wheel_cuda_major(['nvidia-nvimgcodec', 'nvidia-nvimgcodec-cu1x']) == []


def cpu_decoder():
    """A real nvImageCodec Decoder of its CPU backend (libjpeg-turbo), as NvDecoder makes one."""
    return NV.Decoder(device_id=NV.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                      backends=[NV.Backend(NV.BackendKind.CPU_ONLY)])


class Refusing:
    """An nvImageCodec Decoder that gives what `real` gives, but None at the positions in `refuse`
    of each call's list (or everywhere), as a backend that does not take an image returns it;
    `calls` holds how many images each call was handed."""

    def __init__(self, real, refuse):
        self.real, self.refuse, self.calls = real, refuse, []

    def decode(self, sources, **kw):
        self.calls.append(len(sources))
        got = self.real.decode(sources, **kw)
        return [None if self.refuse == 'all' or k in self.refuse else x for k, x in enumerate(got)]


def refusing(backend):
    """A CPU NvDecoder whose one backend is `backend` (a Refusing)."""
    return nvdecode.NvDecoder(NV, torch.device('cpu'), chain=[('cpu', backend)])


@needs_nvimgcodec
def test_what_nvimgcodec_refuses_torchvision_decodes(photos, monkeypatch, capsys):
    """An image nvImageCodec refuses is decoded by torchvision's decoder (counted), in its place: the batch
    is the one nvImageCodec alone gives, within the one level of torchvision's own libjpeg-turbo decode."""
    seeds = [f'3-0-{i}' for i in range(6)]
    want = GD.DeviceDecode()(encoded(photos, seeds), torch.device('cpu'))
    decoder = GD.DeviceDecode()
    cpu = torch.device('cpu')
    decoder._nv[cpu] = refusing(Refusing(cpu_decoder(), {1, 4}))
    decoder.decoder = 'nvimgcodec (refusing)'
    got = decoder(encoded(photos, seeds), cpu)
    assert decoder.nv_refused == 2 and decoder.refused == 0
    assert decoder.record()['nvimgcodec_backends'] == {'cpu': 4}
    assert (got.int() - want.int()).abs().max() <= 1
    assert ("its CPU backend (libjpeg-turbo) 4, torchvision's decoder 2 (nvImageCodec refused them)"
            in capsys.readouterr().err)


@needs_nvimgcodec
def test_a_decoder_that_decodes_nothing_of_the_first_batch_gives_way_to_torchvision(photos, capsys):
    """nvImageCodec without its GPU extension (the nvJPEG wheel missing) returns None for every image: from
    the first batch on, torchvision's decoder decodes, said once with the reason, and summary.json's
    decoder says so."""
    cpu = torch.device('cpu')
    decoder = GD.DeviceDecode()
    decoder._nv[cpu] = refusing(Refusing(cpu_decoder(), 'all'))
    for k in range(2):
        out = decoder(encoded(photos, [f'4-{k}-{i}' for i in range(4)]), cpu)
        assert out.shape == (4, 3, S, S)
    assert decoder._nv[cpu] is None and decoder.decoder.startswith('torchvision ')
    assert 'decoded none of the first batch' in decoder.why_not
    assert decoder.record()['nvimgcodec_backends'] == {'cpu': 0}
    err = capsys.readouterr().err
    assert err.count("dlojz: --decode gpu: torchvision's decode_jpeg decodes whole images") == 1
    assert 'dlojz: --decode gpu: nvImageCodec' not in err


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
        nv.counts['cuda'] += len(boxes)
        return [torch.zeros(3, b[2], b[3], dtype=torch.uint8) for b in boxes]
    nv.counts = {'hardware': 0, 'cuda': 0, 'hybrid': 0}  # as NvDecoder's, the engine refusing all

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
    assert decoder.record()['nvimgcodec_backends'] == {'hardware': 0, 'cuda': 2, 'hybrid': 0}


@needs_nvimgcodec
def test_an_image_of_another_layout_or_size_is_taken_as_it_is_or_left_to_the_fallback(photos):
    """A backend that gives the crop interleaved (H, W, 3) where planar was asked is read as planar; one
    whose size is not the box's is left to the fallback (None), never resized as if it were the crop."""
    nv = nvdecode.NvDecoder(NV, torch.device('cpu'))
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

    def decode(self, sources, **kw):
        self.refuse = 'all' if len(self.calls) >= self.first else set()
        return super().decode(sources, **kw)


@needs_nvimgcodec
def test_a_later_batch_nvimgcodec_refuses_whole_does_not_turn_it_off(photos, capsys):
    """nvImageCodec gives way to torchvision's decoder only when it has decoded nothing on the device
    yet: a later batch it refuses whole (one image, a small last batch of bad files) goes to torchvision's
    decoder, counted, and the next batch is nvImageCodec's again (a review of issue 45 found one such
    batch turned it off for the rest of the run, saying 'none of the first batch')."""
    cpu = torch.device('cpu')
    decoder = GD.DeviceDecode()
    backend = RefusingFrom(cpu_decoder(), 1)
    decoder._nv[cpu] = refusing(backend)
    decoder.decoder = 'nvimgcodec (refusing from the second batch)'
    for k in range(3):
        decoder(encoded(photos, [f'6-{k}-0']), cpu)
    assert decoder._nv[cpu] is not None and backend.calls == [1, 1, 1]
    assert decoder.nv_refused == 2 and 'decoded none' not in capsys.readouterr().err
    assert decoder.record()['nvimgcodec_backends'] == {'cpu': 1}


# -------------------------------------------------------------------------- which backend decoded

def test_on_a_gpu_each_backend_is_a_decoder_of_its_own_the_engine_first():
    """A fake nvImageCodec records the Decoders made for cuda:1: one per backend, hardware engine,
    then CUDA, then hybrid, each holding that backend alone, on that device (one Decoder holding the
    three would hand what the engine refuses to the next without a word)."""
    made = []

    def decoder(**kw):
        made.append(kw)
        return SimpleNamespace(decode=None)
    kinds = SimpleNamespace(HW_GPU_ONLY='hw', GPU_ONLY='gpu', HYBRID_CPU_GPU='hybrid',
                            CPU_ONLY='cpu')
    fake = SimpleNamespace(Decoder=decoder, Backend=lambda kind: f'backend:{kind}',
                           BackendKind=kinds, DecodeParams=lambda **kw: kw, SRGB='srgb',
                           P_RGB='planar', NVIMGCODEC_DEVICE_CPU_ONLY=-99)
    nv = nvdecode.NvDecoder(fake, torch.device('cuda', 1))
    assert [name for name, _ in nv.chain] == ['hardware', 'cuda', 'hybrid']
    assert [(kw['device_id'], kw['backends']) for kw in made] == [
        (1, ['backend:hw']), (1, ['backend:gpu']), (1, ['backend:hybrid'])]
    assert nv.counts == {'hardware': 0, 'cuda': 0, 'hybrid': 0}


@needs_nvimgcodec
def test_the_backends_kinds_exist_in_the_installed_nvimgcodec():
    for _, kind in nvdecode.GPU_BACKENDS + nvdecode.CPU_BACKENDS:
        assert isinstance(getattr(NV.BackendKind, kind), NV.BackendKind), kind


@needs_nvimgcodec
def test_each_backend_decodes_what_those_before_it_refused_and_is_counted(photos):
    """Three backends in a chain (real CPU decoders, the first two refusing some images): each is
    called once, with only the images those before it refused; the counts add up to the batch; the
    crops are the region decoder's, each in its place."""
    batch = encoded(photos, [f'7-0-{i}' for i in range(8)])
    chunks = list(torch.split(batch.data, batch.sizes))
    hardware, cuda = Refusing(cpu_decoder(), {0, 2, 5}), Refusing(cpu_decoder(), {0})
    hybrid = Refusing(cpu_decoder(), set())
    nv = nvdecode.NvDecoder(NV, torch.device('cpu'),
                            chain=[('hardware', hardware), ('cuda', cuda), ('hybrid', hybrid)])
    crops = nv(chunks, batch.boxes)
    assert (hardware.calls, cuda.calls, hybrid.calls) == ([8], [3], [1])
    assert nv.counts == {'hardware': 5, 'cuda': 2, 'hybrid': 1}
    for chunk, (t, l, h, w, _), crop in zip(chunks, batch.boxes, crops):
        want = DD.REGION(chunk.numpy().tobytes(), t, l, h, w)
        assert torch.equal(crop, torch.from_numpy(want).permute(2, 0, 1))
    nv(chunks, batch.boxes)  # the same refusals again: counted again, one call each
    assert nv.counts == {'hardware': 10, 'cuda': 4, 'hybrid': 2} and hybrid.calls == [1, 1]


@needs_nvimgcodec
def test_a_batch_the_first_backend_takes_whole_is_one_call(photos):
    batch = encoded(photos, [f'8-0-{i}' for i in range(6)])
    first, second = Refusing(cpu_decoder(), set()), Refusing(cpu_decoder(), set())
    nv = nvdecode.NvDecoder(NV, torch.device('cpu'), chain=[('hardware', first), ('cuda', second)])
    nv(list(torch.split(batch.data, batch.sizes)), batch.boxes)
    assert first.calls == [6] and second.calls == [] and nv.counts == {'hardware': 6, 'cuda': 0}


def test_the_first_batch_line_says_which_backend_decoded():
    said = nvdecode.first_batch_sentence('0.9.0.20', {'hardware': 250, 'cuda': 4, 'hybrid': 0}, 2)
    assert said == ("nvImageCodec 0.9.0.20 decodes the crops of each batch; of the first batch's "
                    "256 images: the GPU's hardware JPEG decoder 250, nvJPEG's CUDA decoder 4, its "
                    "hybrid CPU/GPU decoder 0, torchvision's decoder 2 (nvImageCodec refused them)")
    none = nvdecode.first_batch_sentence('0.9.0.20', {'hardware': 0, 'cuda': 256, 'hybrid': 0}, 0)
    assert none.endswith("its hybrid CPU/GPU decoder 0; the hardware JPEG decoder took none (this "
                         "GPU has none, or it does not decode regions)")
    assert 'took none' not in nvdecode.first_batch_sentence('0.9.0.20', {'cpu': 3}, 0)


MAPS = """\
55d0c1a00000-55d0c1a01000 r--p 00000000 08:01 1311 /usr/bin/python3.11
7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0
7f3a20000000-7f3a20100000 r-xp 00000000 08:01 2201 /v/nvimgcodec/extensions/libnvjpeg_ext.so.0.9.0
7f3a30000000-7f3a30400000 r-xp 00000000 08:01 2202 /v/nvidia/nvjpeg2k/lib/libnvjpeg2k.so.0
7f3a40000000-7f3a40800000 r-xp 00000000 08:01 2203 /a b/torchvision.libs/libnvjpeg.36e11081.so.13
7f3a50000000-7f3a50800000 r-xp 00000000 08:01 2204 /v/nvidia/nvjpeg/lib/libnvjpeg.so.13
7ffc2d000000-7ffc2d021000 rw-p 00000000 00:00 0 [stack]
"""


def test_the_libnvjpeg_bound_is_the_first_mapped(tmp_path):
    """From a process's maps: the first libnvjpeg mapped (a path with a space kept whole), not
    nvImageCodec's extension libnvjpeg_ext nor nvJPEG2000's libnvjpeg2k; None where none is mapped,
    or where there is no /proc (not Linux)."""
    assert nvdecode.mapped_nvjpeg(MAPS) == '/a b/torchvision.libs/libnvjpeg.36e11081.so.13'
    assert nvdecode.mapped_nvjpeg(MAPS.replace('libnvjpeg.', 'libjpeg.')) is None
    assert nvdecode.mapped_nvjpeg('') is None
    assert nvdecode.bound_nvjpeg(str(tmp_path / 'no-proc' / 'maps')) is None


@needs_nvimgcodec
def test_summary_record_holds_the_backends_counts_and_the_libnvjpeg_bound(photos, monkeypatch):
    """What data.gpu_decode gets from the decoder: the libnvjpeg read once nvImageCodec's decoder is
    made, the images each backend decoded, and the fallbacks' counts."""
    read = []
    monkeypatch.setattr(GD.nvdecode, 'bound_nvjpeg',
                        lambda: read.append('read') or '/x/torchvision.libs/libnvjpeg.1.so.13')
    decoder = GD.DeviceDecode()
    assert decoder.record()['nvimgcodec_backends'] is None and decoder.record()['libnvjpeg'] is None
    decoder(encoded(photos, ['9-0-0', '9-0-1', '9-0-2']), torch.device('cpu'))
    assert read == ['read'] and decoder.record() == {
        'decoder': f'nvimgcodec {region.nvimgcodec_version()}', 'why_not_nvimgcodec': None,
        'nvimgcodec_backends': {'cpu': 3}, 'libnvjpeg': '/x/torchvision.libs/libnvjpeg.1.so.13',
        'torchvision_after_nvimgcodec': 0, 'cpu_after_nvjpeg': 0}
