"""A 4-rank start on an emulated shared file system (tests/fsemu.py: one serving thread, a fixed
cost per operation, each operation counted): the job lists the class folders once, not once per
rank; a second job on the unchanged folder lists none of them (one read of each split folder); a
class folder that gained a file is the one listed again.

Slow tier, and only where FUSE works (root, /dev/fuse, fuse3 and mfusepy: CI's long tier installs
them):
python -m pytest -q -m slow tests/test_fsemu_start.py"""
import json
import os
import shutil

import pytest

import fsemu
from conftest import torchrun

pytestmark = pytest.mark.slow
CLASSES = 30
FLAGS = ['--arch', 'resnet18', '--image-size', '32', '--val-resize', '36', '--val-image-size', '32',
         '-b', '4', '--val-batch-size', '8', '--num-workers', '0', '--wandb', 'off',
         '--test-nsteps', '1']


@pytest.fixture(scope='module')
def tree(tmp_path_factory):
    reason = fsemu.why_unavailable()
    if reason:
        pytest.skip(reason)
    src = tmp_path_factory.mktemp('imagenet-like')
    fsemu.make_tree(str(src), classes=CLASSES, train_per_class=4, val_per_class=2)
    old = 1_600_000_000  # copied long ago: no folder within the index's racy window
    for dirpath, _, _ in os.walk(src):
        os.utime(dirpath, (old, old))
    return src


def start(mount, n, out, cache):
    mount.reset()
    p = torchrun(n, *FLAGS, '--data-dir', mount.mountpoint, '--cache-dir', cache,
                 '--output-dir', out)
    assert p.returncode == 0, p.stderr[-3000:]
    return mount.counts(), json.loads((out / 'summary.json').read_text())


def test_one_listing_per_job_and_none_for_the_next(tree, tmp_path):
    mnt = tmp_path / 'mnt'
    mnt.mkdir()
    cache = tmp_path / 'cache'
    with fsemu.mounted(str(tree), str(mnt), latency=0.0002) as mount:
        counts, s = start(mount, 4, tmp_path / 'first', cache)
        folders = 2 + 2 * CLASSES  # the split folders and every class folder of both
        # once per job: 4 ranks listing each would read 4 x 62 folders (the code before the index)
        assert counts.get('readdir', 0) == folders, counts
        assert s['data']['index']['folders_listed'] == 2 * CLASSES and s['world_size'] == 4
        assert s['startup']['critical_path'] and 'dataset_index' in s['startup']['phases']

        counts, s = start(mount, 4, tmp_path / 'second', cache)
        # the split folders; the classes' lists are the kept ones
        assert counts.get('readdir', 0) == 2, counts
        assert s['data']['index']['folders_listed'] == 0 and s['data']['index']['kept_index']

        cls = sorted(os.listdir(tree / 'train'))[3]
        shutil.copy(next((tree / 'train' / cls).iterdir()), tree / 'train' / cls / 'gained.JPEG')
        counts, s = start(mount, 1, tmp_path / 'third', cache)
        # the split folders and the class folder that changed
        assert counts.get('readdir', 0) == 3, counts
        assert s['data']['train_images'] == CLASSES * 4 + 1
