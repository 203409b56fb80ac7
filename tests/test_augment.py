"""The augmentation flags: worker-side RandAugment / TrivialAugmentWide / random erasing are per-sample
deterministic (same batches whatever the workers, same crops as without them), mixup and cutmix conserve the
label mass and match their lambda in the pixels, and read nothing back from the device (run on 'meta'
tensors, where any read raises), progressive resizing follows its schedule by hand, and a run with all of
them trains.

Run: python -m pytest -q tests/test_augment.py
"""
import math
import os
import random
import tempfile
from argparse import Namespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from conftest import TINY, run_main
import dlojz
from dlojzlib.data import augment as A
from dlojzlib.data import datasets as D
from dlojzlib.data import decode as DD


@pytest.fixture(scope='module')
def train_set(tmp_path_factory):
    root = tmp_path_factory.mktemp('augsynth') / 'data'
    D.ensure_synthetic_dataset(str(root), 2, 6, 1, 0, workers=1, log=lambda *a: None)
    return D.scan_imagefolder(str(root))[1]


def flags(**kw):
    base = dict(randaugment=None, trivialaugment=False, random_erasing=0.0)
    return Namespace(**{**base, **kw})


def test_worker_augmentation_is_per_sample_and_worker_independent(train_set):
    ops = A.worker_ops(flags(randaugment='2,9', random_erasing=0.5))
    ds = D.ImageFolderDataset(train_set, A.Augmented(DD.FastTrainTransform(32), ops), seed=5)
    batches = []
    for workers in (0, 2):
        sampler = D.EpochSampler(ds, seed=5)
        sampler.set_epoch(1)
        loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers)
        batches.append(torch.cat([x for x, _ in loader]))
    assert torch.equal(batches[0], batches[1])
    plain = D.ImageFolderDataset(train_set, DD.FastTrainTransform(32), seed=5)
    differ = sum(not torch.equal(ds[(i, 1)][0], plain[(i, 1)][0]) for i in range(len(ds)))
    assert differ >= len(ds) // 2  # it does change the pixels


def test_augmentation_draws_come_after_the_crop():
    """An augmentation that changes nothing leaves the crop and flip of every sample as they were."""
    transform = DD.TrainTransform(32)
    noop = A.Augmented(DD.TrainTransform(32), v2.RandomErasing(p=0.0))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'x.JPEG')
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(path)
        for i in range(10):
            assert torch.equal(noop(path, random.Random(i)), transform(path, random.Random(i)))


def test_randaugment_flag_is_checked():
    with pytest.raises(ValueError, match='N,M'):
        A.parse_randaugment('2')
    with pytest.raises(ValueError, match='within 0-30'):
        A.parse_randaugment('2,31')
    assert A.parse_randaugment('2,9') == (2, 9)


def distinct_images(n=6, size=16):
    """Image i is filled with the value i + 1: each pixel tells which image it came from."""
    return torch.arange(1, n + 1, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, size, size).clone()


@pytest.mark.parametrize('mixup, cutmix', [(0.4, 0.0), (0.0, 1.0)])
def test_mix_conserves_label_mass_and_matches_lambda(mixup, cutmix):
    torch.manual_seed(0)
    mix = A.Mix(mixup, cutmix, num_classes=5)
    for step in range(20):
        x, y = distinct_images(), torch.tensor([0, 1, 2, 3, 4, 0])
        mixed, soft = mix(x, y, step)
        assert torch.allclose(soft.sum(1), torch.ones(6))  # each row is a distribution
        partner = y.roll(1, 0)
        lam = soft[torch.arange(6), y].clone()
        same = y == partner  # image 0 and 5 share class 0: their row holds lam + (1 - lam)
        lam[same] = float('nan')
        lam = lam[~same][0].item()
        if mixup:  # every pixel is lam x own + (1 - lam) x partner
            want = x * lam + x.roll(1, 0) * (1 - lam)
            torch.testing.assert_close(mixed, want)
        else:  # the partner's pixels cover (1 - lam) of each image
            from_partner = (mixed != x).float().mean(dim=(1, 2, 3))
            assert torch.allclose(from_partner, torch.full((6,), 1 - lam), atol=1e-6)


def test_mix_reads_nothing_from_the_device():
    """On 'meta' tensors any value read (.item(), bool(), a host copy) raises: Mix must not need one."""
    for mixup, cutmix in ((0.2, 0.0), (0.0, 1.0), (0.2, 1.0)):
        mix = A.Mix(mixup, cutmix, num_classes=10)
        for step in range(5):
            x = torch.empty(8, 3, 16, 16, device='meta')
            y = torch.empty(8, dtype=torch.long, device='meta')
            mixed, soft = mix(x, y, step)
            assert mixed.shape == x.shape and soft.shape == (8, 10)
    x = torch.empty(8, 3, 16, 16, device='meta')
    with pytest.raises(Exception):  # the check itself: a read on meta does raise
        x.sum().item()


def test_mix_draws_depend_on_step_and_rank_only():
    """The draws are a function of (seed, step, virtual rank): the same after a resume, whatever came
    before, and different from one step or rank to the next."""
    x, y = distinct_images(), torch.tensor([0, 1, 2, 3, 4, 0])
    a, b = A.Mix(0.4, 1.0, 5, seed=3), A.Mix(0.4, 1.0, 5, seed=3)
    for step in range(5):
        a(x, y, step)  # b has not drawn these
    assert torch.equal(a(x, y, 7, 1)[1], b(x, y, 7, 1)[1])
    assert not torch.equal(b(x, y, 7, 1)[1], b(x, y, 8, 1)[1]) and not torch.equal(b(x, y, 7, 1)[1], b(x, y, 7, 0)[1])


@pytest.mark.slow
def test_a_mixed_run_resumes_exactly(tmp_path, cache_dir):
    """Stopped mid-epoch 2 and resumed, a cutmix + mixup run trains on the uninterrupted run's batches: the
    same losses, bit for bit (a DataLoader iterator draws from torch's global generator, so draws taken
    from it would shift on resume)."""
    flags = ['-e', '2', '--mixup', '0.4', '--cutmix', '1.0', '--log-interval', '1']
    _, full = run_main(tmp_path / 'full', cache_dir, *flags)
    run_main(tmp_path / 'part', cache_dir, *flags, '--chkpt-every', '18', '--test-nsteps', '18')
    _, second = run_main(tmp_path / 'resumed', cache_dir, *flags, '--resume', tmp_path / 'part' / 'checkpoint-00000018.pt')
    losses = lambda recs: {r['global_step']: r['loss'] for r in recs if r['type'] == 'train'}
    ref, got = losses(full), losses(second)
    assert sorted(got) == list(range(19, 25)) and [got[k] for k in got] == [ref[k] for k in got]


def test_progressive_resizing_by_hand(train_set):
    assert [A.resolution(e, 16, 32, 4) for e in range(6)] == [16, 16, 24, 24, 32, 32]  # 16, 20, 24, 28 -> x8
    assert A.resolution(0, 160, 192, 0) == 192
    ds = D.ImageFolderDataset(train_set, DD.FastTrainTransform(32), seed=0)
    ds.resolution = lambda epoch: A.resolution(epoch, 16, 32, 2)
    assert ds[(0, 0)][0].shape[-1] == 16 and ds[(0, 1)][0].shape[-1] == 24 and ds[(0, 2)][0].shape[-1] == 32


@pytest.mark.slow
def test_a_run_with_every_augmentation_trains(tmp_path, cache_dir):
    s, recs = run_main(tmp_path, cache_dir, '-e', '2', '--num-workers', '2', '--mixup', '0.2', '--cutmix', '1.0',
                       '--randaugment', '2,9', '--random-erasing', '0.25', '--trivialaugment', '--res-start', '16',
                       '--log-interval', '1')
    losses = [r['loss'] for r in recs if r['type'] == 'train']
    assert s['status'] == 'completed' and len(losses) == 24 and all(math.isfinite(v) for v in losses)
    assert s['config']['res_end_epoch'] == 1


@pytest.mark.parametrize('extra, words', [(['--decode', 'gpu', '--device', 'cpu', '--randaugment', '2,9'], None),
                                          (['--res-start', '64'], 'larger than --image-size'),
                                          (['--randaugment', '2'], 'takes N,M'),
                                          (['--res-start', '16', '--fake-data'], 'has none'),
                                          (['--res-start', '16', '--compile'], 'one graph per image size')])
def test_augmentation_refusals_are_sentences(capsys, extra, words):
    assert dlojz.cli([*TINY, *extra, '--test-nsteps', '1']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and (words is None or words in err)
