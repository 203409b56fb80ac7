"""--loader dali (data.dali), where NVIDIA DALI is installed (CI installs it in a stage of its own;
the default test command runs without it, and then only the missing-package sentence and the
doctor's sweep are tested here):

- DALI crops the native loader's boxes and flips them alike: on an image that encodes its own coordinates,
  each DALI sample equals --decode fast's for the same (seed, epoch, index) within a few levels;
- an epoch holds the native loader's images, in its order, at world sizes 1 and 2 (each rank's share), and
  validation reads every image once across the ranks;
- an epoch resumed after k steps gives the full epoch's batches from step k on, pixel for pixel;
- a run trains and validates through the real entry point, alone and as 2 torchrun ranks, with the native
  loader's image counts; the loader doctor includes a DALI trial.

Run: python -m pytest -q tests/test_dali.py"""
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import TINY, latest, run_cli, run_main, torchrun
import dlojz
from dlojzlib import flags
from dlojzlib.data import dali
from dlojzlib.data import datasets
from dlojzlib.data import decode as DD
from dlojzlib.errors import UsageError
from dlojzlib.modes import doctor as L

needs_dali = pytest.mark.skipif(dali.dali() is None, reason='NVIDIA DALI is not installed')


def test_missing_dali_is_one_sentence(monkeypatch):
    monkeypatch.setattr(dali, 'dali', lambda: None)
    args = flags.get_args_parser().parse_args(TINY + ['--loader', 'dali'])
    with pytest.raises(UsageError, match=r'^--loader dali needs NVIDIA DALI, which is not installed: pip install '):
        flags.check_args(args, torch.device('cpu'))


def test_what_dali_cannot_do_is_refused():
    args = flags.get_args_parser().parse_args(TINY + ['--loader', 'dali', '--res-start', '16'])
    with pytest.raises(UsageError, match='--loader dali decodes, crops and flips by itself'):
        flags.check_flags(args)


def test_the_doctor_sweeps_dali_when_installed():
    trials = L.sweep(4, False, dali=True)
    assert trials[-1] == {'num_workers': 4, 'prefetch_factor': None, 'pin_memory': None, 'decode': 'dali'}
    assert L.trial_argv(trials[-1]) == ['--num-workers', '4', '--loader', 'dali']
    assert all(t['decode'] != 'dali' for t in L.sweep(4, False))


@pytest.fixture(scope='module')
def coords(tmp_path_factory):
    """An ImageFolder of one class: 12 copies of a 500 x 375 image whose red is x and green is y."""
    w, h = 500, 375
    x = np.round(np.linspace(0, 255, w))[None, :].repeat(h, 0)
    y = np.round(np.linspace(0, 255, h))[:, None].repeat(w, 1)
    img = Image.fromarray(np.stack([x, y, np.full_like(x, 128)], -1).astype(np.uint8))
    root = tmp_path_factory.mktemp('coords')
    for split in ('train', 'val'):
        (root / split / 'a').mkdir(parents=True)
        for i in range(12):
            img.save(root / split / 'a' / f'{i:02d}.JPEG', quality=95)
    return root


def data_of(root, loader, rank=0, world_size=1, *extra):
    args = flags.get_args_parser().parse_args(
        ['--data-dir', str(root), '--image-size', '64', '--val-image-size', '64', '--val-resize', '72', '-b', '4',
         '--val-batch-size', '5', '--num-workers', '1', '--loader', loader, *extra])
    args = flags.check_args(args, torch.device('cpu'))
    dist = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank, is_main=rank == 0)
    return datasets.build_data(args, dist, log=lambda *a: None)


@needs_dali
def test_dali_crops_the_native_boxes_and_flips(coords):
    data = data_of(coords, 'dali')
    fast = DD.FastTrainTransform(64)
    data.set_epoch(3)
    keys = [k for batch in data.train_loader.batch_sampler for k in batch]
    got = torch.cat([x for x, _ in data.train_loader])
    assert got.shape == (12, 3, 64, 64) and got.dtype == torch.uint8
    flips = 0
    for (index, epoch), x in zip(keys, got):
        rng = random.Random(f'{data.train_dataset.seed}-{epoch}-{index}')
        want = fast(data.train_dataset.source(index)[0], rng)
        diff = (x.int() - want.int()).abs().float()
        assert diff.mean() < 2.5, (index, epoch, diff.mean())  # another box or flip: tens of levels
        flips += bool(want[0, 0, 0] > want[0, 0, -1])
    assert 0 < flips < 12  # both ways occur, so the flip was compared too


@needs_dali
@pytest.mark.parametrize('world_size', [1, 2])
def test_an_epoch_holds_the_native_images_in_order(coords, world_size):
    for rank in range(world_size):
        native, dali = data_of(coords, 'native', rank, world_size), data_of(coords, 'dali', rank, world_size)
        for d in (native, dali):
            d.set_epoch(1)
        assert len(native.train_loader) == len(dali.train_loader)
        assert list(dali.train_loader.batch_sampler) == list(native.train_loader.batch_sampler)
        n_native = sum(len(y) for _, y in native.train_loader)
        assert sum(len(y) for _, y in dali.train_loader) == n_native == -(-12 // world_size)
    seen = [y for r in range(world_size) for _, y in data_of(coords, 'dali', r, world_size).val_loader]
    assert sum(len(y) for y in seen) == 12  # each validation image once, whatever the world size
    val = torch.cat([x for x, _ in data_of(coords, 'dali').val_loader])
    ref = torch.stack([DD.ValTransform(72, 64)(str(coords / 'val' / 'a' / f'{i:02d}.JPEG')) for i in range(12)])
    assert (val.int() - ref.int()).abs().float().mean() < 2.5


@pytest.fixture(scope='module')
def ramp16(tmp_path_factory):
    """An ImageFolder of one class: 12 copies of a 16-bit grayscale PNG, a horizontal ramp over the
    whole 16-bit range (Pillow opens it as mode I;16)."""
    row = np.round(np.linspace(0, 65535, 400)).astype(np.uint16)
    img = Image.fromarray(np.tile(row, (300, 1)))
    root = tmp_path_factory.mktemp('ramp16')
    for split in ('train', 'val'):
        (root / split / 'a').mkdir(parents=True)
        for i in range(12):
            img.save(root / split / 'a' / f'{i:02d}.png')
    return root


@needs_dali
def test_both_loaders_see_the_same_levels_of_a_16_bit_png(ramp16):
    """Issue 40: DALI decoded a 16-bit PNG as a ramp while every native path saw pure white, so the
    two loaders trained on different pixels. The validation batches (the same center crops) and the
    training batches (the same boxes and flips) now agree within DALI's resampling, and neither is
    white (a ramp over 0..255 averages about 128)."""
    native, dali = data_of(ramp16, 'native'), data_of(ramp16, 'dali')
    v_native = torch.cat([x for x, _ in native.val_loader]).float()
    v_dali = torch.cat([x for x, _ in dali.val_loader]).float()
    assert abs(v_native.mean() - 127.5) < 20 and (v_native - v_dali).abs().mean() < 2.5
    for d in (native, dali):
        d.set_epoch(0)
    t_native = torch.cat([x for x, _ in native.train_loader]).float()
    t_dali = torch.cat([x for x, _ in dali.train_loader]).float()
    assert t_native.mean() < 200 and (t_native - t_dali).abs().mean() < 2.5


@needs_dali
def test_a_resumed_epoch_gives_the_rest_of_the_epoch(coords):
    data = data_of(coords, 'dali')
    data.set_epoch(2)
    full = [(x, y) for x, y in data.train_loader]
    data.set_epoch(2, start_sample=4)  # one step of 4 images done
    rest = [(x, y) for x, y in data.train_loader]
    assert len(full) == 3 and len(rest) == 2
    for (x, y), (fx, fy) in zip(rest, full[1:]):
        assert torch.equal(x, fx) and torch.equal(y, fy)


@needs_dali
def test_a_run_trains_and_validates_with_dali(tmp_path, cache_dir):
    out = {}
    for loader in ('native', 'dali'):
        out[loader] = tmp_path / loader
        summary = dlojz.main(dlojz.get_args_parser().parse_args(
            TINY + ['--cache-dir', cache_dir, '--output-dir', str(out[loader]), '-e', '1', '--num-workers', '1',
                    '--loader', loader]))
        assert summary['status'] == 'completed' and np.isfinite(summary['val']['loss'])
    native, dali = (json.loads((out[k] / 'summary.json').read_text()) for k in ('native', 'dali'))
    assert dali['data']['dali']['decoder'] == 'cpu' and native['data']['dali'] is None
    assert dali['data']['fast_decode'] is None
    for key in ('train_images', 'val_images', 'batches_per_epoch'):
        assert dali['data'][key] == native['data'][key], key
    assert dali['val']['images'] == native['val']['images'] == native['data']['val_images']


@needs_dali
def test_two_ranks_train_and_validate_with_dali(tmp_path, cache_dir):
    p = torchrun(2, *TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path, '-e', '1', '--loader', 'dali',
                 '--num-workers', '1')
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / 'summary.json').read_text())
    assert s['world_size'] == 2 and s['data']['dali']['decoder'] == 'cpu'
    assert s['val']['images'] == s['data']['val_images']  # every image once across the two ranks


@needs_dali
def test_the_loader_doctor_shows_dali(tmp_path, cache_dir):
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path, '--tune-loader', '--test-nsteps', '3',
                timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    record = json.loads((tmp_path / 'tune-loader.json').read_text())
    assert any(t['decode'] == 'dali' and t['images_per_second'] > 0 for t in record['trials'])
    assert '| dali |' in p.stdout


@needs_dali
def test_a_dali_run_resumed_mid_epoch_repeats_the_uninterrupted_losses(tmp_path, cache_dir):
    """Stopped after 18 of 24 steps (mid-epoch 2) and resumed: the resumed steps see the images,
    crops and flips the uninterrupted run saw, so its losses are the same, bit for bit (CPU)."""
    flags = ['-e', '2', '--log-interval', '1', '--loader', 'dali', '--num-workers', '1']
    _, full = run_main(tmp_path / 'full', cache_dir, *flags)
    run_main(tmp_path / 'part', cache_dir, *flags, '--test-nsteps', '18', '--chkpt')
    _, second = run_main(tmp_path / 'resumed', cache_dir, *flags, '--resume', latest(tmp_path / 'part'))
    train = lambda recs: {r['global_step']: r['loss'] for r in recs if r['type'] == 'train'}  # noqa: E731
    ref, got = train(full), train(second)
    assert sorted(got) == list(range(19, 25)) and [got[k] for k in range(19, 25)] == [ref[k] for k in range(19, 25)]


@needs_dali
def test_a_process_forked_after_a_dali_run_does_not_crash_on_its_pipeline(coords):
    """A DALI pipeline shut down in a forked child (its __del__ at the child's next collection)
    segfaulted the child: a synthetic-dataset worker forked after a DALI run crashed, and its pool
    waited forever."""
    import gc
    import os
    data = data_of(coords, 'dali')
    data.set_epoch(0)
    next(iter(data.train_loader))
    pid = os.fork()
    if pid == 0:  # the child drops the loader and collects: exit 0, or die of the crash
        del data
        gc.collect()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@needs_dali
def test_the_next_batch_is_prepared_while_the_step_trains(coords, monkeypatch):
    import threading
    import time
    data = data_of(coords, 'dali')
    data.set_epoch(0)
    loader, events = data.train_loader, []
    real = loader._batch

    def recorded(keys):
        events.append(('start', keys[0], threading.current_thread().name))
        return real(keys)
    monkeypatch.setattr(loader, '_batch', recorded)
    order = [b[0] for b in loader.batch_sampler]
    for i, _ in enumerate(loader):
        time.sleep(0.2)  # the step
        events.append(('step done', i))
    starts = [e for e in events if e[0] == 'start']
    assert [e[1] for e in starts] == order and all(e[2].startswith('dlojz-dali') for e in starts)
    assert events.index(starts[1]) < events.index(('step done', 0))  # batch 1 began during step 0


def test_a_gpu_given_without_an_index_is_the_current_one(monkeypatch):
    """DaliLoader(..., device='cuda'): its thread's initializer called
    torch.cuda.set_device(torch.device('cuda')), which raises, and the first batch failed. No DALI
    needed: the pipeline and its batches are stand-ins."""
    from test_decode import fake_current_gpu
    chosen = fake_current_gpu(monkeypatch, 1)
    loader = dali.DaliLoader(None, [[0, 1], [2, 3]], train=True, size=8, seed=0,
                                   device='cuda')
    loader._pipe = object()
    loader._batch = lambda keys: keys
    assert list(loader) == [[0, 1], [2, 3]] and chosen == [1]
    assert loader.device == torch.device('cuda', 1)
