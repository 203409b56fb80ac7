"""WebDataset-style shards (dlojz_data.py prepare, dlojzlib/data/shards.py):

- the shards are plain tars, key.<ext> beside key.cls, holding the source files' bytes and labels, and
  the index's offsets point at them (read back with tarfile, independently of dlojz's reader);
- training from the shards gives the folder run's losses and validation bit for bit (same bytes, same
  sampler, same per-sample seeds);
- an interrupted prepare continues to the same bytes as an uninterrupted one; other arguments are refused;
- --max-side re-encodes large images; a damaged sample is named (shard:key) or skipped and counted; a
  truncated shard is named as such (not one of its images); a source image that does not decode is refused
  by its path before it is packed;
- `dlojz_data.py --help` and `prepare --help` answer (exit 0); prepare's errors speak of SRC/DST and exit 2;
- file opens: at most one per worker and shard, against one per image for folders.

Run: python -m pytest -q tests/test_shards.py"""
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

from conftest import ROOT, TINY, latest, run_cli, torchrun
import dlojz
from dlojzlib.data import datasets as D
from dlojzlib.data import decode as DD
from dlojzlib.data import shards as S

SHARD_MB = 2  # the tiny dataset's 96 train images (~100 KB each) make several shards


@pytest.fixture(scope='module')
def folder(cache_dir):
    root = os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0')  # what TINY trains on
    D.ensure_synthetic_dataset(root, 4, 24, 6, 0, log=lambda m: None)
    return root


@pytest.fixture(scope='module')
def shards(folder, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp('shards') / 'ds')
    S.prepare(folder, dst, shard_size_mb=SHARD_MB, log=lambda m: None)
    return dst


def test_shards_are_tars_of_the_source_files(folder, shards):
    classes, train, val = D.scan_imagefolder(folder)
    got_classes, splits = S.load_index(shards)
    assert got_classes == classes
    for split, samples in (('train', train), ('val', val)):
        names, table = splits[split]
        assert len(table) == len(samples) and (len(names) > 2 if split == 'train' else True)
        keyed = {}
        for k, name in enumerate(names):
            with tarfile.open(os.path.join(shards, name)) as tar:
                members = tar.getmembers()
                assert [m.name.split('.')[0] for m in members][::2] == [m.name.split('.')[0] for m in members][1::2]
                for image, cls in zip(members[::2], members[1::2]):
                    assert cls.name.endswith('.cls')
                    keyed[int(image.name.split('.')[0])] = (k, image.offset_data, image.size,
                                                            int(tar.extractfile(cls).read()),
                                                            tar.extractfile(image).read())
        for i, (path, label) in enumerate(samples):
            shard, offset, size, lab, data = keyed[i]
            assert list(table[i]) == [shard, offset, size, label] and lab == label
            with open(path, 'rb') as f:
                assert f.read() == data  # stored as they are without --max-side


@pytest.mark.slow
def test_training_from_shards_equals_training_from_folders(folder, shards, tmp_path, cache_dir):
    runs = {}
    for name, data in (('folder', folder), ('shards', shards)):
        out = tmp_path / name
        assert dlojz.cli([*TINY, '--data-dir', data, '--output-dir', str(out), '-e', '2', '--log-interval', '1',
                          '--num-workers', '2']) == 0
        with open(out / 'metrics.jsonl') as f:
            recs = [json.loads(line) for line in f]
        with open(out / 'summary.json') as f:
            summary = json.load(f)
        runs[name] = ([(r['global_step'], r['loss']) for r in recs if r['type'] == 'train'],
                      [(r['loss'], r['top1'], r['images']) for r in recs if r['type'] == 'val'], summary)
    assert runs['shards'][0] == runs['folder'][0] and len(runs['folder'][0]) == 24
    assert runs['shards'][1] == runs['folder'][1] and runs['folder'][1][-1][2] == 24  # every val image once
    data = runs['shards'][2]['data']
    assert data['source'] == 'shards' and runs['folder'][2]['data']['shard_file_opens'] is None
    n_shards = len(S.load_index(shards)[1]['train'][0])
    # persistent workers: each opens a shard once, whatever the epochs; 96 x 2 files opened on
    # folders
    assert 0 < data['shard_file_opens'] <= 2 * n_shards


def test_an_interrupted_prepare_continues_to_the_same_bytes(folder, shards, tmp_path):
    dst = str(tmp_path / 'ds')
    with pytest.raises(KeyboardInterrupt):
        S.prepare(folder, dst, shard_size_mb=SHARD_MB, log=lambda m: None, stop_after=2)
    assert not os.path.exists(os.path.join(dst, S.INDEX))  # no index until every shard is whole
    done = sorted(n for n in os.listdir(dst) if n.endswith('.tar'))
    assert len(done) == 2
    before = {n: os.path.getmtime(os.path.join(dst, n)) for n in done}
    S.prepare(folder, dst, shard_size_mb=SHARD_MB, log=lambda m: None)
    assert {n: os.path.getmtime(os.path.join(dst, n)) for n in done} == before  # kept, not rewritten
    names = sorted(n for n in os.listdir(shards) if not n.endswith('.tmp'))
    assert sorted(os.listdir(dst)) == names
    for n in names:
        if n != 'prepare.json':
            with open(os.path.join(dst, n), 'rb') as a, open(os.path.join(shards, n), 'rb') as b:
                assert a.read() == b.read(), n
    with pytest.raises(D.DataError, match='holds a prepare with other arguments or another source \\(max_side\\)'):
        S.prepare(folder, dst, max_side=64, shard_size_mb=SHARD_MB, log=lambda m: None)
    r = prepare_cli(folder, dst, '--max-side', '64', '--shard-size', SHARD_MB)  # the same refusal, exit 2
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'other arguments' in r.stderr, r.stderr


def test_a_full_disk_during_prepare_is_one_sentence_and_leaves_no_temporary_file(
        folder, tmp_path, capsys, monkeypatch):
    """ENOSPC at the third file's flush (prepare.json, then a shard, then its sidecar): exit 2, one
    line naming the file and what to do, the files before it kept, no .tmp left (the shards' writer
    left its temporary file and raised a bare OSError before it shared the run's atomic writer)."""
    dst = tmp_path / 'ds'
    flushed = []

    def fsync(fd):
        flushed.append(fd)
        if len(flushed) == 3:
            raise OSError(28, 'No space left on device')
    monkeypatch.setattr(os, 'fsync', fsync)
    assert S.main(['prepare', folder, str(dst), '--shard-size', str(SHARD_MB)]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1, err
    assert err.startswith('dlojz_data.py prepare: error: no space left on '), err
    assert 'while writing train-00000.tar.json' in err
    assert 'run `python dlojz_data.py prepare` again' in err
    assert sorted(os.listdir(dst)) == ['prepare.json', 'train-00000.tar']


def prepare_cli(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_data.py'), 'prepare', *map(str, argv)],
                          capture_output=True, text=True)


def test_max_side_reencodes_and_trains(folder, tmp_path):
    dst = str(tmp_path / 'small')
    # the tool's main in this process: a fresh interpreter would import torch again (4 s on 2 cores)
    assert S.main(['prepare', folder, dst, '--max-side', '64', '--shard-size', str(SHARD_MB)]) == 0
    ds = D.ShardDataset(dst, *S.load_index(dst)[1]['train'], transform=lambda src, rng: DD.load_rgb(src))
    sizes = {ds[i][0].size for i in range(len(ds))}
    assert max(max(s) for s in sizes) == 64  # ImageNet-sized sources, longer side now 64
    assert dlojz.cli([*TINY, '--data-dir', dst, '--output-dir', str(tmp_path / 'run'), '--test-nsteps', '3']) == 0
    r = prepare_cli(tmp_path / 'no', tmp_path / 'x')
    assert r.returncode == 2 and f'SRC {tmp_path / "no"} does not exist' in r.stderr and 'Traceback' not in r.stderr
    assert '--data-dir' not in r.stderr and 'synthetic' not in r.stderr  # prepare's own words, not training's


# The data tool run as `python dlojz_data.py ...` would be (runpy, __main__), saying at its exit
# whether torch was imported on the way: its help and its refusals need no torch (4 s on 2 cores).
TOOL = """
import atexit, runpy, sys
atexit.register(lambda: print('TORCH', 'torch' in sys.modules))
sys.argv = ['dlojz_data.py'] + sys.argv[1:]
runpy.run_path('dlojz_data.py', run_name='__main__')
"""


def test_data_tool_help_comes_before_torch(tmp_path):
    for argv, code, words in ((['--help'], 0, 'ImageFolder tree'),
                              (['prepare', '--help'], 0, '--max-side'),
                              (['prepare', str(tmp_path / 'no'), str(tmp_path / 'x')], 2,
                               'does not exist')):
        r = subprocess.run([sys.executable, '-c', TOOL, *argv], capture_output=True, text=True,
                           cwd=ROOT)
        said = r.stdout + r.stderr
        assert r.returncode == code and words in said, said
        assert r.stdout.splitlines()[-1] == 'TORCH False', said


def test_a_source_image_that_does_not_decode_is_refused_by_name(folder, tmp_path):
    src = tmp_path / 'src'
    shutil.copytree(folder, src)
    bad = sorted((src / 'train').glob('*/*'))[7]
    bad.write_bytes(bad.read_bytes()[:len(bad.read_bytes()) // 2])  # truncated JPEG
    with pytest.raises(D.DataError, match=f'{bad} cannot be decoded'):
        S.prepare(str(src), str(tmp_path / 'dst'), shard_size_mb=SHARD_MB, log=lambda m: None)


def test_a_truncated_shard_is_named_as_such(shards, tmp_path):
    dst = str(tmp_path / 'cut')
    shutil.copytree(shards, dst)
    names, table = S.load_index(dst)[1]['train']
    shard, offset, size, _ = (int(v) for v in table[5])
    with open(os.path.join(dst, names[shard]), 'r+b') as f:
        f.truncate(offset + size // 2)  # cut inside sample 5
    ds = D.ShardDataset(dst, names, table, DD.FastTrainTransform(32), skip_bad_images=True)
    with pytest.raises(D.DataError, match=f'shard {os.path.join(dst, names[shard])} is truncated'):
        ds[(5, 0)]


def test_a_damaged_sample_is_named_or_skipped(shards, tmp_path):
    dst = str(tmp_path / 'bad')
    shutil.copytree(shards, dst)
    names, table = S.load_index(dst)[1]['train']
    shard, offset, size, _ = (int(v) for v in table[5])
    with open(os.path.join(dst, names[shard]), 'r+b') as f:
        f.seek(offset)
        f.write(b'\0' * size)
    strict = D.ShardDataset(dst, names, table, DD.FastTrainTransform(32))
    with pytest.raises(DD.BadImageError, match=f'cannot decode image {names[shard]}:00000005'):
        strict[(5, 0)]
    lenient = D.ShardDataset(dst, names, table, DD.FastTrainTransform(32), skip_bad_images=True)
    x, label = lenient[(5, 0)]
    assert x.shape == (3, 32, 32) and label == int(table[6][3]) and lenient.bad_images == 1


def test_opens_per_worker_and_shard(shards):
    names, table = S.load_index(shards)[1]['train']
    ds = D.ShardDataset(shards, names, table, DD.FastTrainTransform(32))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, sampler=D.EpochSampler(ds, 0))
    for epoch in range(2):  # workers not persistent: each epoch's workers open the shards again
        loader.sampler.set_epoch(epoch)
        assert sum(len(y) for _, y in loader) == len(ds)
    assert 0 < ds.file_opens <= 2 * 2 * len(names) < 2 * len(ds)


def _train_losses(out):
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        return {r['global_step']: r['loss'] for r in map(json.loads, f) if r['type'] == 'train'}


@pytest.mark.slow
def test_a_run_from_shards_resumes_mid_epoch_exactly(folder, shards, tmp_path):
    """Killed (SIGKILL) while writing its checkpoint at step 10; --resume auto continues from step
    5, in the middle of the first epoch, to the losses of the uninterrupted folder run."""
    flags = [*TINY, '--data-dir', shards, '-e', '2', '--log-interval', '1', '--num-workers', '2']
    ref, out = tmp_path / 'ref', tmp_path / 'run'
    assert dlojz.cli([*TINY, '--data-dir', folder, '-e', '2', '--log-interval', '1', '--output-dir', str(ref)]) == 0
    killed = run_cli(*flags, '--output-dir', out, '--chkpt-every', '5', env={'DLOJZ_FAULT': 'kill-in-checkpoint:2'})
    assert killed.returncode == -9 and str(latest(out)).endswith('checkpoint-00000005.pt')
    r = run_cli(*flags, '--output-dir', out, '--resume', 'auto')
    assert r.returncode == 0 and 'checkpoint-00000005.pt' in r.stdout, r.stderr[-2000:]
    assert _train_losses(out) == _train_losses(ref) and len(_train_losses(ref)) == 24


@pytest.mark.slow
def test_validation_from_shards_is_exact_at_any_world_size(cache_dir, tmp_path):
    """25 validation images in shards: 1 and 2 ranks (13 + 12 images) give the same loss and top-1."""
    five = ['--synthetic-classes', '5', '--synthetic-val-per-class', '5', '--val-batch-size', '4']
    src = os.path.join(cache_dir, 'synthetic-v1-c5-n24-v5-s0')
    D.ensure_synthetic_dataset(src, 5, 24, 5, 0, log=lambda m: None)
    dst = str(tmp_path / 'shards')
    S.prepare(src, dst, shard_size_mb=1, log=lambda m: None)
    assert len(S.load_index(dst)[1]['val'][0]) >= 2  # the 25 images span shards
    flags = [*TINY, *five, '--data-dir', dst]
    assert dlojz.cli([*flags, '--output-dir', str(tmp_path / 'train'), '--test-nsteps', '3', '--chkpt']) == 0
    ckpt = str(latest(tmp_path / 'train'))
    assert dlojz.cli([*flags, '--output-dir', str(tmp_path / 'w1'), '--evaluate', '--resume', ckpt]) == 0
    p = torchrun(2, *flags, '--output-dir', tmp_path / 'w2', '--evaluate', '--resume', ckpt)
    assert p.returncode == 0, p.stderr[-3000:]
    vals = []
    for w in ('w1', 'w2'):
        with open(tmp_path / w / 'summary.json') as f:
            vals.append(json.load(f)['val'])
    assert vals[0]['images'] == vals[1]['images'] == 25 and vals[0]['top1'] == vals[1]['top1']
    assert vals[1]['loss'] == pytest.approx(vals[0]['loss'], rel=1e-5)
