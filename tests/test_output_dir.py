"""A run folder holds one run: a second run into a folder that holds another is refused with a sentence and
nothing of the first is touched; --overwrite replaces it (its checkpoints included); --resume continues it.
Each checkpoint write prints its path and step.

Run: python -m pytest -q tests/test_output_dir.py
"""
import os

import dlojz
from conftest import TINY


def cli(out, cache_dir, *flags):
    return dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--test-nsteps', '2', '--chkpt',
                      *map(str, flags)])


def snapshot(out):
    return {n: open(os.path.join(out, n), 'rb').read() for n in sorted(os.listdir(out))}


def test_a_folder_holds_one_run(tmp_path, cache_dir, capsys):
    out = tmp_path / 'run'
    assert cli(out, cache_dir) == 0
    assert f'Checkpoint {out}/checkpoint-00000002.pt written (step 2)' in capsys.readouterr().out
    first = snapshot(out)
    assert cli(out, cache_dir, '--seed', '7') == 2
    err = capsys.readouterr().err
    assert f'dlojz: error: --output-dir {out} already holds a run (checkpoint-00000002.pt, config.json, ' \
           f'metrics.jsonl, summary.json); pass --resume auto to continue it, --overwrite to replace it' in err
    assert snapshot(out) == first
    assert cli(out, cache_dir, '--seed', '7', '--test-nsteps', '1', '--overwrite') == 0
    assert sorted(os.listdir(out)) == ['checkpoint-00000001.pt', 'config.json', 'metrics.jsonl', 'summary.json']
    assert cli(out, cache_dir, '--seed', '7', '--test-nsteps', '1', '--resume', 'auto') == 0
    assert 'continuing from' in capsys.readouterr().out


def test_an_early_error_leaves_no_empty_folder(tmp_path, cache_dir, capsys):
    out = tmp_path / 'run'
    assert cli(out, cache_dir, '--data-dir', tmp_path / 'missing') == 2
    assert 'does not exist' in capsys.readouterr().err and not out.exists()
