"""Data pipeline: the synthetic dataset (layout, ImageNet-like sizes, determinism, valid JPEGs, the
quirk files real ImageNet holds), bad-file handling, data-source resolution and data-directory
errors, and per-sample augmentation that does not depend on the number of workers (the modules'
import directions are tests/test_layout.py's).

Run: python -m pytest -q tests/test_data.py"""
import glob
import os
import shutil
from argparse import Namespace

import numpy as np
import pytest
import torch
from PIL import Image

from dlojzlib.data import datasets as D
from dlojzlib.data import decode as DD
from dlojzlib.errors import loader_error_message

CLASSES, TRAIN, VAL = 3, 6, 2


@pytest.fixture(scope='module')
def synth(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('synth') / 'ds')
    assert D.ensure_synthetic_dataset(root, CLASSES, TRAIN, VAL, seed=7, log=lambda m: None)
    return root


def files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith('.JPEG'))


def test_layout_and_counts(synth):
    classes, train, val = D.scan_imagefolder(synth)
    assert classes == [f'n{c:08d}' for c in range(CLASSES)]
    assert len(train) == CLASSES * TRAIN and len(val) == CLASSES * VAL
    assert sorted({label for _, label in train}) == list(range(CLASSES))
    assert not D.ensure_synthetic_dataset(synth, CLASSES, TRAIN, VAL, seed=7)  # cached: not regenerated


def test_imagenet_like_images(synth):
    sizes, dims = [], []
    for rel in files(synth):
        path = os.path.join(synth, rel)
        with Image.open(path) as im:
            dims.append(im.size)
            fmt = im.format
        if fmt == 'JPEG':
            sizes.append(os.path.getsize(path))
    assert all(300 <= w <= 700 and 300 <= h <= 700 for w, h in dims)
    assert len({round(w / h, 2) for w, h in dims}) >= 3  # varied aspect ratios
    assert 80e3 <= np.mean(sizes) <= 120e3, np.mean(sizes)
    arr = np.asarray(Image.open(os.path.join(synth, files(synth)[-1])).convert('L'), np.float32)
    assert arr.std() > 10  # textured, not a flat colour
    # natural-image statistics: neighbouring pixels are strongly correlated (pure noise would be ~0)
    assert np.corrcoef(arr[:, :-1].ravel(), arr[:, 1:].ravel())[0, 1] > 0.8


def test_deterministic(synth, tmp_path):
    again = str(tmp_path / 'again')
    D.ensure_synthetic_dataset(again, CLASSES, TRAIN, VAL, seed=7, log=lambda m: None, workers=1)
    assert files(again) == files(synth)
    for rel in files(synth):
        with open(os.path.join(synth, rel), 'rb') as a, open(os.path.join(again, rel), 'rb') as b:
            assert a.read() == b.read(), rel
    a, b = (np.asarray(D.synthetic_image(seed, 'train', 1, 0, CLASSES)) for seed in (7, 8))
    assert a.shape != b.shape or not np.array_equal(a, b)  # another seed, another dataset


def test_a_generator_process_that_dies_is_an_error_not_a_wait(tmp_path, monkeypatch):
    """A process generating the synthetic dataset killed by SIGKILL (the OOM killer; failpoint
    kill-generator): one sentence naming the signal, status oom, no half-written folder kept, and
    the next run generates it. multiprocessing.Pool waited forever for the killed worker's task."""
    import time

    from dlojzlib import failpoints
    from dlojzlib.errors import OutOfMemory
    monkeypatch.setattr(failpoints, 'ARMED', {'kill-generator': '3'})
    monkeypatch.setattr(failpoints, '_hits', {})
    root = tmp_path / 'synthetic'
    t = time.time()
    with pytest.raises(OutOfMemory, match=r'was killed \(SIGKILL; most likely by the kernel\'s out-of-memory'):
        D.ensure_synthetic_dataset(str(root), 2, 8, 2, seed=0, workers=2, log=lambda *a: None)
    assert time.time() - t < 60 and os.listdir(tmp_path) == []
    monkeypatch.setattr(failpoints, 'ARMED', {})
    assert D.ensure_synthetic_dataset(str(root), 2, 8, 2, seed=0, workers=2, log=lambda *a: None)
    assert len(glob.glob(str(root / '*' / '*' / '*.JPEG'))) == 2 * (8 + 2)


def test_quirk_files_decode_to_rgb(synth):
    folder = os.path.join(synth, 'train', 'n00000000')
    modes = {}
    for i in range(4):
        path = os.path.join(folder, f'train_0000_{i:05d}.JPEG')
        with Image.open(path) as im:
            modes[i] = (im.format, im.mode, im.info.get('progressive', 0) or im.info.get('progression', 0))
        rgb = DD.load_rgb(path)
        assert rgb.mode == 'RGB' and min(rgb.size) >= 300
    assert modes[0][:2] == ('JPEG', 'L')
    assert modes[1][:2] == ('JPEG', 'CMYK')
    assert modes[2][0] == 'PNG'
    assert modes[3][0] == 'JPEG' and modes[3][2]


def test_bad_image_stops_with_its_name_or_is_skipped_and_counted(synth, tmp_path):
    root = str(tmp_path / 'bad')
    shutil.copytree(synth, root)
    victim = os.path.join(root, 'train', 'n00000001', 'train_0001_00002.JPEG')
    data = open(victim, 'rb').read()
    open(victim, 'wb').write(data[:len(data) // 3])  # truncated, as after an interrupted copy
    _, train, _ = D.scan_imagefolder(root)
    index = [p for p, _ in train].index(victim)
    strict = D.ImageFolderDataset(train, DD.FastTrainTransform(32))
    with pytest.raises(DD.BadImageError, match='train_0001_00002.JPEG'):
        strict[index]
    lenient = D.ImageFolderDataset(train, DD.FastTrainTransform(32), skip_bad_images=True)
    img, label = lenient[index]
    assert img.shape == (3, 32, 32) and lenient.bad_images == 1
    # through a worker process of dlojz's loader: the message still names the file
    loader = D.DataLoader(strict, batch_size=len(train), num_workers=1)
    it = iter(loader)
    with pytest.raises(DD.BadImageError) as e:
        next(it)
    assert 'train_0001_00002.JPEG' in loader_error_message(e.value)
    assert loader_error_message(e.value).startswith('cannot decode image')
    # and its worker is stopped now: left to the garbage collector (the exception holds the
    # iterator in a cycle), it was terminated 5 s later, in whatever the process did then
    assert it._workers and not any(w.is_alive() for w in it._workers)


def test_augmentation_is_per_sample_and_worker_independent(synth):
    _, train, _ = D.scan_imagefolder(synth)
    ds = D.ImageFolderDataset(train, DD.FastTrainTransform(32), seed=5)
    batches = []
    for workers in (0, 2):
        sampler = D.EpochSampler(ds, seed=5)
        sampler.set_epoch(3)
        loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers)
        batches.append(torch.cat([x for x, _ in loader]))
    assert torch.equal(batches[0], batches[1])
    assert not torch.equal(ds[(0, 0)][0], ds[(0, 1)][0])  # another epoch, another crop


def test_epoch_sampler_order_resume_and_shards():
    s = D.EpochSampler(range(10), seed=1)
    s.set_epoch(2)
    full = [i for i, _ in s]
    assert sorted(full) == list(range(10))
    s.set_epoch(2, start_sample=4)
    assert [i for i, _ in s] == full[4:] and len(s) == 6
    s.set_epoch(3)
    assert [i for i, _ in s] != full
    shards = [list(D.EpochSampler(range(10), 1, rank=r, world_size=3)) for r in range(3)]
    assert all(len(x) == 4 for x in shards)
    assert {i for sh in shards for i, _ in sh} == set(range(10))


@pytest.mark.parametrize('n,world', [(10, 3), (96, 2), (25, 4), (7, 1)])
def test_epoch_sampler_matches_torch_distributed_sampler(n, world):
    """The reference is torch's own DistributedSampler: same order, padding and shard for every
    rank."""
    for rank in range(world):
        ref = torch.utils.data.distributed.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                                                              seed=123)
        ours = D.EpochSampler(range(n), 123, rank=rank, world_size=world)
        for epoch in (0, 4):
            ref.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert [i for i, e in ours] == list(ref) and {e for _, e in ours} == {epoch}


def test_shard_sampler_counts_every_validation_image_once():
    for n, world in [(25, 2), (25, 3), (7, 4), (2, 3)]:
        shards = [list(D.ShardSampler(n, r, world)) for r in range(world)]
        assert sorted(i for sh in shards for i in sh) == list(range(n))  # no duplicates, no gaps
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_random_resized_crop_params_within_bounds():
    import random
    rng = random.Random(0)
    for _ in range(500):
        top, left, h, w = DD.random_resized_crop_params(rng, 500, 375)
        assert 0 <= top and top + h <= 375 and 0 <= left and left + w <= 500
        assert 0.08 * 500 * 375 * 0.9 <= h * w <= 500 * 375


def ns(**kw):
    base = dict(fake_data=False, data_dir=None, cache_dir='/c', synthetic_classes=2, synthetic_train_per_class=1,
                synthetic_val_per_class=1, synthetic_seed=0)
    return Namespace(**{**base, **kw})


def test_data_source_resolution_order(tmp_path):
    scratch = tmp_path / 'scratch'
    (scratch / 'imagenet' / 'train').mkdir(parents=True)
    assert D.resolve_data_source(ns(fake_data=True), {}).kind == 'fake'
    assert D.resolve_data_source(ns(data_dir='/d'), {'DLOJZ_DATA_DIR': '/e'}).root == '/d'
    assert D.resolve_data_source(ns(), {'DLOJZ_DATA_DIR': '/e', 'ALL_CCFRSCRATCH': str(scratch)}).root == '/e'
    src = D.resolve_data_source(ns(), {'ALL_CCFRSCRATCH': str(scratch)})
    assert src.root == str(scratch / 'imagenet') and 'Jean Zay' in src.reason
    assert D.resolve_data_source(ns(), {'ALL_CCFRSCRATCH': str(tmp_path / 'none')}).kind == 'synthetic'
    dsdir = tmp_path / 'dsdir'  # Jean Zay's shared dataset store, after the user's own copy
    (dsdir / 'imagenet' / 'RawImages' / 'train').mkdir(parents=True)
    src = D.resolve_data_source(ns(), {'ALL_CCFRSCRATCH': str(tmp_path / 'none'), 'DSDIR': str(dsdir)})
    assert src.root == str(dsdir / 'imagenet' / 'RawImages') and '$DSDIR' in src.reason
    assert D.resolve_data_source(ns(), {'ALL_CCFRSCRATCH': str(scratch), 'DSDIR': str(dsdir)}).root == \
        str(scratch / 'imagenet')


def test_data_directory_errors(tmp_path, synth):
    with pytest.raises(D.DataError, match='does not exist'):
        D.scan_imagefolder(str(tmp_path / 'missing'))
    (tmp_path / 'a-file').write_text('')  # --data-dir naming a file: not "does not exist"
    with pytest.raises(D.DataError, match='^--data-dir .*a-file is a file, not a folder; .*synthetic dataset'):
        D.scan_imagefolder(str(tmp_path / 'a-file'))
    (tmp_path / 'empty' / 'train').mkdir(parents=True)
    (tmp_path / 'empty' / 'val').mkdir(parents=True)
    with pytest.raises(D.DataError, match='no class folder'):
        D.scan_imagefolder(str(tmp_path / 'empty'))
    mism = tmp_path / 'mismatch'
    shutil.copytree(synth, mism)
    shutil.rmtree(mism / 'val' / 'n00000002')
    with pytest.raises(D.DataError, match='different classes'):
        D.scan_imagefolder(str(mism))
