"""What a person reads: the steps actually run when --test-nsteps asks for more than the epochs hold, a
warning on single-class data, the hint for ImageNet's flat val/ folder, a short config line.

Run: python -m pytest -q tests/test_messages.py
"""
import numpy as np
from PIL import Image

import dlojz
from conftest import TINY


def jpegs(folder, n):
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((40, 40, 3), 40 * i % 255, np.uint8)).save(folder / f'img{i}.JPEG')


def run(tmp_path, *flags):
    return dlojz.cli([*TINY, '--output-dir', str(tmp_path / 'run'), *map(str, flags)])


def test_steps_run_and_short_config(tmp_path, cache_dir, capsys):
    assert run(tmp_path, '--cache-dir', cache_dir, '--test-nsteps', 200) == 0
    out = capsys.readouterr().out
    assert 'Note: --test-nsteps 200 is more than 1 epoch(s) of 12 steps hold: running 12 steps' in out
    config = next(line for line in out.splitlines() if line.startswith('Config'))
    assert 'test_nsteps=200' in config and 'seed=' not in config and 'optimizer=' not in config
    assert '>>> Training on 1 node and 1 process\n' in out


def test_flat_val_folder_gets_the_hint(tmp_path, capsys):
    jpegs(tmp_path / 'data' / 'train' / 'n01', 4)
    jpegs(tmp_path / 'data' / 'val', 4)
    assert run(tmp_path, '--data-dir', tmp_path / 'data', '--test-nsteps', 1) == 2
    assert "It holds 4 images directly: ImageNet's raw val/ is flat" in capsys.readouterr().err


def test_single_class_is_warned(tmp_path, capsys):
    jpegs(tmp_path / 'data' / 'train' / 'n01', 8)
    jpegs(tmp_path / 'data' / 'val' / 'n01', 4)
    assert run(tmp_path, '--data-dir', tmp_path / 'data', '--test-nsteps', 1) == 0
    assert 'Warning: the data has a single class (n01)' in capsys.readouterr().out
