"""The fast path's two savings, each against an independent reference:

- region decoding (nvImageCodec's libjpeg-turbo, data.decode.RegionDecoder) gives the pixels of
  simplejpeg's whole-file decode cropped, bit for bit, on 4:2:0, 4:4:4, grayscale and progressive
  files; --decode fast gives the same tensors with it and without it, and uses it (counted); a
  truncated file still fails whatever its crop; the summary says which decoder took how many images,
  and why not when it is off;
- batches handed over in shared slots (data.handover) equal torch's default collate's, batch for
  batch, through real workers that run ahead of a slow consumer, over epochs, with and without
  persistent workers; a worker never writes a slot the main process has not copied out (the permits,
  driven by hand), a batch dropped unread gives its slot back, and an older generation's batch never
  frees a newer one's slot.

Run: python -m pytest -q tests/test_handover.py"""
import io
import json
import pickle
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import TINY
import dlojz
from dlojzlib.data import datasets
from dlojzlib.data import decode as DD
from dlojzlib.data import handover as HO
from dlojzlib.data.workers import DataLoader

simplejpeg = pytest.importorskip('simplejpeg')


def photo(w=500, h=375, seed=0):
    """A textured RGB image (the synthetic dataset's generator), JPEG-compressible like a photo."""
    return datasets.synthetic_image(seed, 'train', seed % 10, seed, 10).resize((w, h))


def jpeg(img, **kw):
    buf = io.BytesIO()
    img.save(buf, 'JPEG', quality=90, **kw)
    return buf.getvalue()


needs_region = pytest.mark.skipif(DD.REGION.why_not is not None,
                                  reason=f'no region decoder: {DD.REGION.why_not}')


@needs_region
@pytest.mark.parametrize('kind', ['420', '444', 'gray', 'progressive'])
def test_region_is_the_whole_decode_cropped(kind):
    img = photo(seed=3)
    data = {'420': lambda: jpeg(img), '444': lambda: jpeg(img, subsampling=0),
            'gray': lambda: jpeg(img.convert('L')), 'progressive': lambda: jpeg(img, progressive=True)}[kind]()
    whole = simplejpeg.decode_jpeg(data, 'RGB')
    rng = random.Random(kind)
    for _ in range(30):
        top, left = rng.randrange(0, 370), rng.randrange(0, 495)
        h, w = rng.randint(1, 375 - top), rng.randint(1, 500 - left)
        got = DD.REGION(data, top, left, h, w)
        assert got is not None and got.shape == (h, w, 3), (top, left, h, w)
        assert np.array_equal(got, whole[top:top + h, left:left + w]), (kind, top, left, h, w)


@needs_region
def test_fast_transform_is_the_same_with_and_without_regions(tmp_path, monkeypatch):
    path = tmp_path / 'a.JPEG'
    path.write_bytes(jpeg(photo(seed=5)))
    fast = DD.FastTrainTransform(224)
    DD.REGION.reset()
    with_region = [fast(str(path), random.Random(f'0-0-{i}')) for i in range(40)]
    used = DD.REGION.counts[0]
    monkeypatch.setattr(DD.REGION, 'why_not', 'turned off by the test')
    without = [fast(str(path), random.Random(f'0-0-{i}')) for i in range(40)]
    assert used == 40  # every 224 px crop of a 500 x 375 file: region, no DCT scaling applies
    for i, (a, b) in enumerate(zip(with_region, without)):
        assert torch.equal(a, b), i


@needs_region
def test_a_truncated_file_fails_even_when_its_crop_is_above_the_cut(tmp_path, monkeypatch):
    data = jpeg(photo(seed=7))
    path = tmp_path / 'cut.JPEG'
    path.write_bytes(data[:len(data) * 2 // 3])
    assert DD.REGION(path.read_bytes(), 0, 0, 60, 60) is not None  # what the region decoder alone would give
    monkeypatch.setattr(DD, 'random_resized_crop_params', lambda rng, w, h: (0, 0, 60, 60))
    with pytest.raises(DD.BadImageError, match='cannot decode image .*cut.JPEG'):
        DD.FastTrainTransform(32)(str(path), random.Random(0))


def loader_only(out, cache_dir):
    argv = TINY + ['--loader-only', '--num-workers', '2', '--test-nsteps', '6', '--output-dir', str(out),
                   '--cache-dir', cache_dir]
    dlojz.main(dlojz.get_args_parser().parse_args(argv))
    return json.loads((out / 'summary.json').read_text())['data']


def test_summary_says_which_decoder_and_how_the_batches_came(tmp_path, cache_dir, monkeypatch):
    data = loader_only(tmp_path / 'a', cache_dir)
    fast, hand = data['fast_decode'], data['handover']
    taken = fast['images_region'] + fast['images_whole_file'] + fast['images_pil']
    assert taken >= 6 * 8  # the batches drawn (and what the workers prefetched), 8 images each
    if DD.REGION.why_not is None:
        assert fast['region_decoder'].startswith('nvimgcodec') and fast['images_region'] > 0
    assert hand['batches_in_slots'] >= 4 and hand['batches_stacked_default'] == 0
    monkeypatch.setattr(DD.REGION, 'why_not', 'turned off by DLOJZ_REGION_DECODE=0')
    monkeypatch.setenv('DLOJZ_HANDOVER', 'default')
    data = loader_only(tmp_path / 'b', cache_dir)
    assert data['fast_decode']['region_decoder'] is None and data['fast_decode']['images_region'] == 0
    assert 'DLOJZ_REGION_DECODE' in data['fast_decode']['why_not'] and data['handover'] is None


# ------------------------------------------------------------------------------------------ hand-over

class Pictures(torch.utils.data.Dataset):
    """Batches whose every byte says which sample it is: image i is filled with (i * 7 + c) % 251."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = torch.empty(3, 8, 8, dtype=torch.uint8)
        for c in range(3):
            x[c] = (i * 7 + c) % 251
        return x, i % 5


@pytest.mark.parametrize('persistent', [False, True])
def test_shared_batches_equal_the_default_collates(persistent):
    ds = Pictures()
    kw = dict(batch_size=6, shuffle=False, num_workers=2, prefetch_factor=2,
              persistent_workers=persistent)
    reference = [b for b in DataLoader(ds, **kw)]
    collate = HO.SharedCollate(2, 2, 6, 8)
    loader = DataLoader(ds, collate_fn=collate, **kw)
    for epoch in range(2):
        got = []
        for x, y in loader:
            got.append((x, y))
            time.sleep(0.02)  # a slow consumer: the workers run as far ahead as their permits let them
        assert len(got) == len(reference) == 7
        for (x, y), (rx, ry) in zip(got, reference):  # all held to the end: copies, not views of a slot
            assert torch.equal(x, rx) and torch.equal(y, ry) and x.dtype == torch.uint8 and y.dtype == torch.int64
    stats = collate.stats()
    assert stats['batches_in_slots'] == 14 and stats['batches_stacked_default'] == 0


def test_a_stopped_epoch_gives_its_slots_back_to_persistent_workers():
    ds = Pictures()
    collate = HO.SharedCollate(1, 2, 6, 8)
    loader = DataLoader(ds, batch_size=6, num_workers=1, prefetch_factor=2, persistent_workers=True,
                        collate_fn=collate)
    for i, _ in enumerate(loader):  # the epoch stops after 2 batches, 2 more made and never read
        if i == 1:
            break
    time.sleep(0.3)
    full = [x for x, _ in loader]
    assert len(full) == 7 and collate.stats()['batches_stacked_default'] == 0


def _in_worker(monkeypatch, wid=0):
    monkeypatch.setattr(HO, 'get_worker_info', lambda: SimpleNamespace(id=wid))


def _receive(batch):
    """What the main process gets from the queue: the worker's object, pickled and rebuilt."""
    return pickle.loads(pickle.dumps(batch))


def test_a_slot_is_written_again_only_after_its_batch_was_copied_out(monkeypatch):
    monkeypatch.setattr(HO, 'WAIT_S', 0.01)
    _in_worker(monkeypatch)
    collate = HO.SharedCollate(1, 1, 4, 8)  # prefetch 1: two slots
    ds = Pictures()
    batch = lambda k: [ds[4 * k + j] for j in range(4)]
    first, second = _receive(collate(batch(0))), _receive(collate(batch(1)))
    assert isinstance(first, HO.SlotBatch) and isinstance(second, HO.SlotBatch)
    third = collate(batch(2))  # no permit left: stacked the default way, slot 0 untouched
    assert isinstance(third, list) and collate.stats()['batches_stacked_default'] == 1
    x0, y0 = first.materialize()
    assert torch.equal(x0, torch.stack([s[0] for s in batch(0)])) and y0.tolist() == [0, 1, 2, 3]
    fourth = _receive(collate(batch(3)))  # slot 0 again
    assert fourth.slot == 0 and torch.equal(x0, torch.stack([s[0] for s in batch(0)]))  # the copy stays
    assert torch.equal(second.materialize()[0], torch.stack([s[0] for s in batch(1)]))
    assert torch.equal(fourth.materialize()[0], torch.stack([s[0] for s in batch(3)]))


def test_a_dropped_batch_frees_its_slot_and_an_old_generation_frees_nothing(monkeypatch):
    monkeypatch.setattr(HO, 'WAIT_S', 0.01)
    _in_worker(monkeypatch)
    collate = HO.SharedCollate(1, 1, 4, 8)
    ds = Pictures()
    batch = [ds[j] for j in range(4)]
    a, b = _receive(collate(batch)), _receive(collate(batch))
    del a  # dropped unread (a stopped epoch): its permit comes back
    assert isinstance(collate(batch), HO.SlotBatch)
    collate.new_generation()  # new workers, new permits: two
    c, d = _receive(collate(batch)), _receive(collate(batch))
    del b  # generation 1's: must not free a generation-2 slot
    assert isinstance(collate(batch), list)
    del c
    assert isinstance(collate(batch), HO.SlotBatch) and d.generation == 2


def test_slots_that_would_not_fit_in_shared_memory_are_not_made(monkeypatch):
    """A 64 MB /dev/shm (a container's default) or a typo'd image size: torch's own hand-over, and
    the reason."""
    collate, why = HO.make(1, 2, 8, 22400)  # 12 GB of slots: more than this machine's shared memory
    assert collate is None and 'shared batch slots' in why
    collate, why = HO.make(1, 2, 8, 32)
    assert isinstance(collate, HO.SharedCollate) and why is None
    monkeypatch.setattr(HO.os, 'statvfs', lambda path: SimpleNamespace(f_bavail=16384, f_frsize=4096))  # 64 MiB
    collate, why = HO.make(1, 2, 32, 224)  # 3 slots x 4.6 MiB: within a quarter of it
    assert isinstance(collate, HO.SharedCollate)
    collate, why = HO.make(8, 2, 256, 224)  # 8 workers x 3 slots x 36.8 MiB = 882 MiB
    assert collate is None and why == 'the shared batch slots would take 882 MiB of the 64 MiB free in /dev/shm'


def test_a_loaders_slots_go_with_it():
    collate = HO.SharedCollate(1, 2, 4, 8)
    ref = __import__('weakref').ref(collate.blocks)
    key = collate.id
    del collate
    assert ref() is None and key not in HO.SharedCollate.registry


@needs_region
def test_the_region_path_meets_torchvisions_resized_crop_as_the_whole_file_path_does(tmp_path, monkeypatch):
    """Against torchvision's own resized_crop of the fully decoded image (PIL), same boxes and
    flips: the region path is within the tolerance the whole-file path meets."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF
    path = tmp_path / 'b.JPEG'
    path.write_bytes(jpeg(photo(seed=11)))
    img = Image.open(path).convert('RGB')
    fast = DD.FastTrainTransform(224)

    def worst_error():
        errors = []
        for i in range(30):
            got = fast(str(path), random.Random(f'1-2-{i}'))
            rng = random.Random(f'1-2-{i}')  # the transform's draws, repeated: the box, then the flip
            top, left, h, w = DD.random_resized_crop_params(rng, img.width, img.height)
            want = TF.pil_to_tensor(TF.resized_crop(img, top, left, h, w, [224, 224], InterpolationMode.BILINEAR,
                                                    antialias=True))
            want = want.flip(-1) if rng.random() < 0.5 else want
            errors.append((got.int() - want.int()).abs().float().mean().item())
        return max(errors)
    DD.REGION.reset()
    region = worst_error()
    assert DD.REGION.counts[0] == 30
    monkeypatch.setattr(DD.REGION, 'why_not', 'turned off by the test')
    whole = worst_error()
    print(f'mean abs error vs torchvision, worst sample: region {region:.3f}, whole file {whole:.3f} levels')
    assert region <= whole + 0.01 and region < 1.5


def test_nvimgcodecs_absent_extension_lines_are_dropped_and_others_kept(capfd):
    """Without DALI's extra wheels (nvJPEG2000, nvTIFF), importing nvImageCodec printed 9 lines on
    stderr in every worker, and the tests that read a run's stderr failed on the floors."""
    import os
    from dlojzlib.data import region

    def noisy():
        os.write(2, b'Failed to load nvjpeg2k library! Please install nvJPEG2000 (see https://docs.nvidia.com).\n')
        os.write(2, b"Note: If using nvImageCodec's Python distribution, it is enough to install the wheel\n")
        os.write(2, b'[ERROR] [nvtiff_ext] Failed to load nvTIFF library or retrieve version. Decoders and encoders '
                    b'will not be registered.\n')
        os.write(2, b'a genuine error\n')
        return 7
    assert region._made_quietly(noisy) == 7
    assert capfd.readouterr().err == 'a genuine error\n'
