"""Bad inputs end in one sentence, never a traceback or a hang (issue 21, items 5, 6 and 7): each row gives an
input, the exit code, the words of the one 'dlojz:' line on stderr, and what the folders hold afterwards.

- a FIFO named x.JPEG in a class folder (opening it blocks forever) and a dangling link are not samples:
  named in a warning, the run trains on the regular files (a link to a regular file stays a sample);
- a class folder empty in train/ and val/ is named in a warning;
- an epoch whose last batch would hold one image (BatchNorm cannot train on it) leaves that image out, with a
  note, instead of crashing;
- a checkpoint without 'rng', one whose optimizer has another number of parameter groups, one whose weights
  are another architecture's, and a folder passed to --resume: the checkpoint is named with what differs;
- a shards folder without index-train.npy or index.json: an incomplete prepare, and how to finish it.

In-process through dlojz.cli (as tests/test_exits.py), with an alarm so that a hang fails instead of blocking.
Run: python -m pytest -q tests/test_bad_inputs.py
"""
import glob
import json
import os
import shutil
import signal

import pytest
import torch

from conftest import TINY
import dlojz
from dlojzlib.data import datasets as D
from dlojzlib.data import shards as S


class Hang(Exception):
    pass


def cli(capsys, *flags, limit_s=120):
    """dlojz.cli(TINY + flags) under an alarm -> (exit code, stdout, stderr)."""
    def alarm(signum, frame):
        raise Hang(f'dlojz did not end within {limit_s} s')
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(limit_s)
    try:
        code = dlojz.cli([*TINY, *[str(f) for f in flags]])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err, prefix='dlojz: error:'):
    """The single stderr line starting with `prefix`; no traceback anywhere."""
    assert 'Traceback' not in err, err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope='module')
def synth(cache_dir):
    root = os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0')  # what TINY trains on
    D.ensure_synthetic_dataset(root, 4, 24, 6, 0, log=lambda m: None)
    return root


def link_tree(src, dst, classes=2, train=4, val=2):
    """A small ImageFolder copy of src made of links to its files (links to regular files are samples)."""
    for split, n in (('train', train), ('val', val)):
        for folder in sorted(os.listdir(os.path.join(src, split)))[:classes]:
            os.makedirs(os.path.join(dst, split, folder))
            for f in sorted(os.listdir(os.path.join(src, split, folder)))[:n]:
                os.symlink(os.path.join(src, split, folder, f), os.path.join(dst, split, folder, f))
    return dst


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory, cache_dir):
    """A checkpoint of the tiny run after 2 steps."""
    out = tmp_path_factory.mktemp('ckpt')
    assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--test-nsteps', '2',
                      '--chkpt']) == 0
    [path] = glob.glob(str(out / 'checkpoint-*.pt'))
    return path


def edited(checkpoint, tmp_path, edit):
    ckpt = torch.load(checkpoint, map_location='cpu', weights_only=False)
    edit(ckpt)
    path = str(tmp_path / 'edited.pt')
    torch.save(ckpt, path)
    return path


def test_fifo_and_dangling_link_are_named_and_skipped(synth, tmp_path, cache_dir, capsys):
    root = link_tree(synth, str(tmp_path / 'data'))
    cls = sorted(os.listdir(os.path.join(root, 'train')))[0]
    os.mkfifo(os.path.join(root, 'train', cls, 'x.JPEG'))
    os.symlink('/nonexistent.JPEG', os.path.join(root, 'val', cls, 'gone.JPEG'))
    # a whole epoch, so that every training sample is opened: before the fix the FIFO blocked it for good
    code, out, err = cli(capsys, '--data-dir', root, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'out',
                         '-e', '1', '-b', '4')
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith('dlojz: warning:')]
    assert len(warnings) == 2 and 'Traceback' not in err, err
    assert f'{os.path.join(cls, "x.JPEG")}' in warnings[0] and 'not regular files' in warnings[0]
    assert f'{os.path.join(cls, "gone.JPEG")}' in warnings[1]
    _, train, val = D.scan_imagefolder(root)
    assert len(train) == 8 and len(val) == 4  # the links to the synthetic files; not the FIFO, not the dangling link


def test_empty_class_folder_is_named(synth, tmp_path, cache_dir, capsys):
    root = link_tree(synth, str(tmp_path / 'data'))
    for split in ('train', 'val'):
        os.makedirs(os.path.join(root, split, 'zz_empty'))
    code, out, err = cli(capsys, '--data-dir', root, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'out',
                         '--test-nsteps', '1')
    assert code == 0
    assert 'zz_empty' in one_line(err, 'dlojz: warning:')
    assert json.load(open(tmp_path / 'out' / 'summary.json'))['data']['classes'] == 2


def test_single_image_last_batch_is_left_out(synth, tmp_path, cache_dir, capsys):
    # 2 classes x 5 training images, -b 3: 3 batches of 3 and one of a single image, which BatchNorm refuses
    root = link_tree(synth, str(tmp_path / 'data'), train=5)
    code, out, err = cli(capsys, '--data-dir', root, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'out',
                         '-e', '1', '-b', '3')
    assert code == 0, err
    assert 'Traceback' not in err
    notes = [line for line in out.splitlines() if line.startswith('Note: ') and 'single image' in line]
    assert len(notes) == 1, out
    summary = json.load(open(tmp_path / 'out' / 'summary.json'))
    assert summary['status'] == 'completed'
    assert summary['global_step'] == 3 and summary['data']['batches_per_epoch'] == 3  # 10 // 3, by hand
    assert summary['val']['batches'] == 1 and summary['val']['top1'] is not None


def drop_rng(ckpt):
    del ckpt['rng']


def extra_group(ckpt):
    groups = ckpt['optimizer']['param_groups']
    groups.append({**groups[-1], 'params': []})


def other_arch(ckpt):
    ckpt['arch'] = 'resnet34'  # resnet18's weights labelled as resnet34: the load itself must be refused


@pytest.mark.parametrize('edit, flags, words', [
    (drop_rng, [], ["lacks 'rng'"]),
    (extra_group, [], ['parameter groups', '--optimizer sgd']),
    (other_arch, ['--arch', 'resnet34'], ["do not fit this run's --arch resnet34 model", 'layer']),
], ids=['no-rng', 'param-groups', 'other-arch'])
def test_bad_checkpoint(checkpoint, tmp_path, cache_dir, capsys, edit, flags, words):
    path = edited(checkpoint, tmp_path, edit)
    out_dir = tmp_path / 'out'
    code, out, err = cli(capsys, '--cache-dir', cache_dir, '--output-dir', out_dir, '--test-nsteps', '1',
                         '--resume', path, *flags)
    line = one_line(err)
    assert code == 2 and path in line and all(w in line for w in words), line
    assert not out_dir.exists()  # refused before anything was written
    assert os.path.getsize(path) > 0


def test_resume_folder(checkpoint, tmp_path, cache_dir, capsys):
    folder = os.path.dirname(checkpoint)
    before = sorted(os.listdir(folder))
    code, out, err = cli(capsys, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'out', '--test-nsteps', '1',
                         '--resume', folder)
    line = one_line(err)
    assert code == 2 and 'is a folder, not a checkpoint file' in line and f'--resume auto --output-dir {folder}' \
        in line, line
    assert sorted(os.listdir(folder)) == before and not (tmp_path / 'out').exists()


@pytest.mark.parametrize('remove', ['index-train.npy', 'index.json'])
def test_incomplete_shards(synth, tmp_path, cache_dir, capsys, remove):
    dst = str(tmp_path / 'shards')
    S.prepare(synth, dst, shard_size_mb=4, log=lambda m: None)
    os.remove(os.path.join(dst, remove))
    code, out, err = cli(capsys, '--data-dir', dst, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'out',
                         '--test-nsteps', '1')
    line = one_line(err)
    assert code == 2 and 'incomplete `dlojz_data.py prepare`' in line and remove in line, line
    assert f'python dlojz_data.py prepare SRC {dst}' in line
    assert not (tmp_path / 'out').exists()
    # the sentence's own advice finishes it
    S.prepare(synth, dst, shard_size_mb=4, log=lambda m: None)
    assert os.path.exists(os.path.join(dst, remove))
    shutil.rmtree(dst)


def no_val(dst):
    with open(os.path.join(dst, 'index.json')) as f:
        index = json.load(f)
    del index['splits']['val']
    with open(os.path.join(dst, 'index.json'), 'w') as f:
        json.dump(index, f)


def fewer_classes(dst):
    with open(os.path.join(dst, 'index.json')) as f:
        index = json.load(f)
    index['classes'] = index['classes'][:2]  # the tables still hold labels 0 to 3
    with open(os.path.join(dst, 'index.json'), 'w') as f:
        json.dump(index, f)


def truncate(name, keep=40):
    def edit(dst):
        with open(os.path.join(dst, name), 'r+b') as f:
            f.truncate(keep)
    return edit


def not_json(dst):
    with open(os.path.join(dst, 'index.json'), 'w') as f:
        f.write('{"format": ')


def shard_cut(dst):
    """The first training shard loses its second half after prepare."""
    with open(os.path.join(dst, 'index.json')) as f:
        first = json.load(f)['splits']['train']['shards'][0]['name']
    truncate(first, os.path.getsize(os.path.join(dst, first)) // 2)(dst)


@pytest.mark.parametrize('edit, file, words', [
    (truncate('index-train.npy'), 'index-train.npy', 'not a table numpy can read'),
    (no_val, 'index.json', 'nothing at splits.val where a split'),
    (fewer_classes, 'index-train.npy', 'labels from 0 to 3 for the 2 classes'),
    (not_json, 'index.json', 'not JSON'),
    (shard_cut, 'train-00000.tar', 'bytes, where index-train.npy reads up to byte'),
], ids=['damaged table', 'no val split', 'fewer classes than labels', 'unparseable index',
        'shard cut short'])
def test_a_damaged_shards_folder_is_named_with_the_fix(synth, tmp_path, cache_dir, capsys, edit,
                                                       file, words):
    """dlojz's own files read on trust (issue 40): a numpy error or a KeyError traceback, an
    IndexError in the middle of an epoch, an unparseable index.json called missing. Now: the damaged
    file named, with the fix that works (a new prepare of a deleted folder; prepare itself resumes a
    finished folder as finished), before anything is written."""
    dst = str(tmp_path / 'shards')
    S.prepare(synth, dst, shard_size_mb=4, log=lambda m: None)
    edit(dst)
    flags = ['--data-dir', dst, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'out',
             '--test-nsteps', '1']
    code, out, err = cli(capsys, *flags)
    line = one_line(err)
    assert code == 2 and f'{os.path.join(dst, file)} is damaged' in line and words in line, line
    assert f'delete {dst} and prepare it again' in line
    assert not (tmp_path / 'out').exists()
    shutil.rmtree(dst)  # the sentence's fix: a new prepare of the deleted folder trains
    S.prepare(synth, dst, shard_size_mb=4, log=lambda m: None)
    code, out, err = cli(capsys, *flags)
    assert code == 0, err[-2000:]
