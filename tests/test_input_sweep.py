"""Every command answers a bad input with one sentence (issue 40): a table of bad inputs per
command, each run as a user would (a subprocess of the command's script), checked for the exit code,
no traceback, the one error line naming what is wrong, and that nothing already written changed (the
folders the case touches are listed with their sizes and modification times before and after).

Kinds: a number out of its range (every command), a combination that leaves nothing to do, a value
that would become code (the Slurm generator), the environment dlojz reads, dlojz's own files
damaged, staging folders that cannot be used. Decoding (16-bit images) is tests/test_decode.py's and
tests/test_dali.py's; a second signal, tests/test_preempt.py's.

python -m pytest -q -m slow tests/test_input_sweep.py"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, TINY

pytestmark = pytest.mark.slow


def tree(*folders):
    """{path: (size, mtime_ns)} of every file under the folders: what 'nothing changed' reads."""
    out = {}
    for folder in folders:
        for dirpath, _, names in os.walk(folder):
            for n in names:
                p = os.path.join(dirpath, n)
                st = os.lstat(p)
                out[p] = (st.st_size, st.st_mtime_ns)
    return out


def run(script, *argv, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def refused(r, words, code=2):
    """Exit `code`, no traceback, one error line holding each of `words`."""
    text = r.stdout + r.stderr
    assert r.returncode == code, (r.returncode, text[-2000:])
    assert 'Traceback' not in text, text[-3000:]
    errors = [line for line in r.stderr.splitlines() if 'error:' in line]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])


@pytest.fixture(scope='module')
def written(tmp_path_factory, cache_dir):
    """A finished run folder and a prepared shards folder, which a refused command must leave as
    they are."""
    root = tmp_path_factory.mktemp('written')
    r = run('dlojz.py', *TINY, '--test-nsteps', '2', '--cache-dir', cache_dir,
            '--output-dir', root / 'run')
    assert r.returncode == 0, r.stderr[-2000:]
    synth = [d for d in os.listdir(cache_dir) if d.startswith('synthetic')][0]
    r = run('dlojz_data.py', 'prepare', os.path.join(cache_dir, synth), root / 'shards',
            '--shard-size', 2)
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(root / 'shards', root / 'damaged')
    with open(root / 'damaged' / 'index-val.npy', 'r+b') as f:
        f.truncate(30)
    # a one-device summary whose traffic factor is not a number
    with open(root / 'run' / 'summary.json') as f:
        odd = json.load(f)
    odd['communication'] = {'gradient_bytes_per_step': 4000, 'traffic_factor': 'x'}
    os.makedirs(root / 'odd')
    with open(root / 'odd' / 'summary.json', 'w') as f:
        json.dump(odd, f)
    # a sharded checkpoint (one process, --shard full) copied without DCP's metadata
    r = run('dlojz.py', *TINY, '--test-nsteps', '2', '--cache-dir', cache_dir, '--shard', 'full',
            '--chkpt', '--output-dir', root / 'sharded')
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(root / 'sharded' / 'checkpoint-00000002.dcp',
                    root / 'cut' / 'checkpoint-00000002.dcp')
    os.remove(root / 'cut' / 'checkpoint-00000002.dcp' / '.metadata')
    # round 4: a shards index naming a file out of its folder, and one that is a FIFO
    for name in ('escaping', 'fifo-index'):
        shutil.copytree(root / 'shards', root / name)
    with open(root / 'escaping' / 'index.json') as f:
        index = json.load(f)
    index['splits']['train']['shards'][0]['name'] = '../../x'
    with open(root / 'escaping' / 'index.json', 'w') as f:
        json.dump(index, f)
    os.remove(root / 'fifo-index' / 'index.json')
    os.mkfifo(root / 'fifo-index' / 'index.json')
    # round 4: a FIFO where a file is read, and runs that cannot be a --slowed-from
    os.makedirs(root / 'special')
    os.mkfifo(root / 'special' / 'fifo.json')
    for name, change in (('one', {'communication': {'gradient_bytes_per_step': 4000,
                                                    'traffic_factor': 1.0}}),
                         ('other-flags', {'world_size': 2, 'config': {'batch_size': 64}}),
                         ('crashed', {'world_size': 2, 'status': 'crashed'})):
        with open(root / 'run' / 'summary.json') as f:
            other = json.load(f)
        other['config'].update(change.pop('config', {}))
        other.update(change)
        with open(root / 'special' / f'{name}.json', 'w') as f:
            json.dump(other, f)
    return root, os.path.join(cache_dir, synth)


# (command, argv with {run}, {shards}, {damaged}, {synth}, {cache}, {new} for paths, the words of
# the error line[, the environment]); T: a run of the tiny config into {new}
T = [*TINY, '--cache-dir', '{cache}', '--output-dir', '{new}']
FAKE = ['--fake-data', '--output-dir', '{new}']
FORECAST = '--summary x --machine a100'.split()
# one srun task of a one-task step: what get_dist_info reads before the variable under test
SRUN = {'SLURM_PROCID': '0', 'SLURM_STEP_ID': '0', 'SLURM_NTASKS': '1', 'SLURM_LOCALID': '0',
        'SLURM_JOB_ID': '4242', 'SLURM_JOB_NODELIST': 'localhost'}
CASES = {
    # dlojz.py: numbers where they enter, and combinations with nothing to do
    'seed negative': ('dlojz.py', ['--seed', '-1'], ['--seed', '-1']),
    'synthetic seed too large': ('dlojz.py', ['--synthetic-seed', str(2 ** 32)],
                                 ['--synthetic-seed']),
    'tune budget negative': ('dlojz.py', ['--tune-budget', '-1'], ['--tune-budget', '-1']),
    'tune steps zero': ('dlojz.py', ['--tune-steps', '0'], ['--tune-steps']),
    'tune max batch negative': ('dlojz.py', ['--tune-max-batch', '-8'], ['--tune-max-batch']),
    'an LR sweep whose end is below its start': ('dlojz.py', ['--findlr', '--lr', '1e-9'],
                                                 ['--findlr', '--lr 1e-09']),
    'batch of one at 32 px': ('dlojz.py', [*T, '-b', '1'], ['-b 1', '32 px']),
    'global batch over the training set': ('dlojz.py', [*T, '-b', '2', '--accum-steps', '400'],
                                           ['global batch of 800', 'training set (96 images)']),
    # 2 steps of 8 images are 2 steps of 6 and 4 images of the 3rd: a run of 2 ends before them
    'a resume ending inside its checkpoint\'s last step': (
        'dlojz.py', [*T, '--resume', '{sharded}', '-b', '6', '--allow-batch-change',
                     '--test-nsteps', '2'],
        ['is at step 2 and partway through step 3 of 6 images', '--test-nsteps 3 or more']),
    # the workers' first batches, left out of the rate, would be all there is
    'a loader alone with nothing to time': ('dlojz.py', [*T, '--loader-only', '--test-nsteps', '4',
                                                         '--num-workers', '2'],
                                            ['--loader-only reads the 4 batches', 'first 4']),
    # CUDA graphs under DDP: one process here, the world size from torchrun's variables
    'CUDA graphs under DDP': ('dlojz.py', [*FAKE, '--compile', '--compile-mode', 'reduce-overhead'],
                              ['--compile-mode reduce-overhead captures CUDA graphs'],
                              {'RANK': '0', 'WORLD_SIZE': '2', 'LOCAL_RANK': '0',
                               'LOCAL_WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1',
                               'MASTER_PORT': '29999'}),
    # dlojz.py: a pipeline's flags
    'pipeline stages zero': ('dlojz.py', ['--pipeline-stages', '0'], ['--pipeline-stages', "'0'"]),
    'pipeline split not block numbers': ('dlojz.py', ['--pipeline-split', '4,x'],
                                         ['--pipeline-split', "'4,x'"]),
    'pipeline split beyond the blocks': ('dlojz.py', [*T, '--arch', 'timm:vit_tiny_patch16_224',
                                                      '--microbatches', '2', '--pipeline-split',
                                                      '99'],
                                         ['--pipeline-split 99', 'one stage']),
    'pipeline stages over the ranks': ('dlojz.py', [*T, '--arch', 'timm:vit_tiny_patch16_224',
                                                    '--pipeline-stages', '2'],
                                       ['--pipeline-stages 2 needs a multiple of 2 ranks']),
    # dlojz.py: the environment it reads
    'a DLOJZ_ variable misspelt': ('dlojz.py', FAKE, ['DLOJZ_DATADIR'],
                                   {'DLOJZ_DATADIR': '{shards}'}),
    'a DLOJZ_ value misspelt': ('dlojz.py', FAKE, ["DLOJZ_HANDOVER='defualt'"],
                                {'DLOJZ_HANDOVER': 'defualt'}),
    # the seam that makes a CPU run take a GPU run's choices (dlojzlib.choices)
    'the CUDA seam not 0 or 1': ('dlojz.py', FAKE, ["DLOJZ_AS_IF_CUDA='yes'", 'takes 0 or 1'],
                                 {'DLOJZ_AS_IF_CUDA': 'yes'}),
    'OMP_NUM_THREADS not a number': ('dlojz.py', FAKE, ['OMP_NUM_THREADS'],
                                     {'OMP_NUM_THREADS': 'four'}),
    'the data folder named by its variable': ('dlojz.py', T, ['$DLOJZ_DATA_DIR', 'unset it'],
                                              {'DLOJZ_DATA_DIR': '{new}-missing'}),
    # round 4 (issue 49): the launcher's variables, each through its parser
    'a node list whose range holds letters': ('dlojz.py', FAKE, ["SLURM_JOB_NODELIST='jz[a-b]'"],
                                              {**SRUN, 'SLURM_JOB_NODELIST': 'jz[a-b]'}),
    'a node list no cluster has': ('dlojz.py', FAKE, ['SLURM_JOB_NODELIST', '100000 nodes'],
                                   {**SRUN, 'SLURM_JOB_NODELIST': 'n[0-999999999]'}),
    'tasks on no node': ('dlojz.py', FAKE, ["SLURM_TASKS_PER_NODE='2(x0)'"],
                         {**SRUN, 'SLURM_TASKS_PER_NODE': '2(x0)'}),
    'a restart count that is no number': ('dlojz.py', FAKE, ["SLURM_RESTART_COUNT='x'"],
                                          {'SLURM_RESTART_COUNT': 'x'}),
    'a rank that is no number': ('dlojz.py', FAKE, ["RANK='x'"],
                                 {'RANK': 'x', 'WORLD_SIZE': '1', 'MASTER_PORT': '29999'}),
    # dlojz.py: its own files, and staging
    'a sharded checkpoint without its metadata': (
        'dlojz.py', [*T, '--evaluate', '--resume', '{cut}'],
        ['checkpoint-00000002.dcp cannot be read', 'resume from another checkpoint']),
    'a damaged shard table': ('dlojz.py', [*T, '--data-dir', '{damaged}'],
                              ['index-val.npy is damaged']),
    'a shards index naming a file out of its folder': (
        'dlojz.py', [*T, '--data-dir', '{escaping}'],
        ['index.json is damaged', 'splits.train.shards[0].name']),
    'a shards index that is a FIFO': ('dlojz.py', [*T, '--data-dir', '{fifo_index}'],
                                      ['index.json', 'a FIFO']),
    'staging into the data folder': ('dlojz.py', [*T, '--data-dir', '{shards}', '--stage-dir',
                                                  '{shards}'], ['is the shards folder']),
    'staging to an empty name': ('dlojz.py', [*T, '--data-dir', '{shards}', '--stage-dir', ''],
                                 ['--stage-dir is empty']),
    # dlojz_data.py prepare
    'prepare max side negative': ('dlojz_data.py', 'prepare {synth} {new} --max-side -5'.split(),
                                  ['--max-side', '-5']),
    'prepare shard size zero': ('dlojz_data.py', 'prepare {synth} {new} --shard-size 0'.split(),
                                ['--shard-size', '0']),
    'prepare shard size nan': ('dlojz_data.py', 'prepare {synth} {shards} --shard-size nan'.split(),
                               ['--shard-size']),
    # dlojz_slurm.py: values that become lines of a script
    'slurm time not a time': ('dlojz_slurm.py', ['--dry-run', '--time', 'two hours'], ['--time']),
    'slurm account with a newline': ('dlojz_slurm.py', ['--dry-run', '--account',
                                                        'me\n#SBATCH --mem=1'], ['--account']),
    'slurm qos with a space': ('dlojz_slurm.py', ['--dry-run', '--qos', 'a b'], ['--qos']),
    'slurm gpus zero': ('dlojz_slurm.py', ['--dry-run', '--gpus', '0'], ['--gpus 0']),
    'slurm recipe at a size it has no plan for': (
        'dlojz_slurm.py', '--dry-run --machine h100 --gpus 1 --recipe coatnet7'.split(),
        ['--recipe coatnet7', '--gpus 1']),
    # dlojz_scaling.py
    'forecast gpus not numbers': ('dlojz_scaling.py', [*FORECAST, '--gpus', '1,x'],
                                  ['--gpus', '1,x']),
    'pipeline forecast of a run without a pipeline': (
        'dlojz_scaling.py', ['--pipeline', '{run}/summary.json'],
        ['timing.pipeline', '--pipeline-stages run']),
    'pipeline forecast of zero microbatches': (
        'dlojz_scaling.py', ['--pipeline', '{run}/summary.json', '--microbatches', '4,0'],
        ['--microbatches', '4,0']),
    'forecast cores negative': ('dlojz_scaling.py', [*FORECAST, '--cores', '-1'], ['--cores']),
    'forecast traffic factor not a number': (
        'dlojz_scaling.py', '--summary {odd} --machine a100'.split(),
        ['communication.traffic_factor', "'x'"]),
    # round 4: what cannot be a forecast, and a FIFO at each kind of input
    'forecast from a FIFO': ('dlojz_scaling.py', ['--summary', '{special}/one.json', '--machine',
                                                  'a100', '--measured', '{special}/fifo.json'],
                             ['--measured', 'is a FIFO, not a file']),
    'slowed from a run of other flags': (
        'dlojz_scaling.py', ['--summary', '{special}/one.json', '--machine', 'a100',
                             '--slowed-from', '{special}/other-flags.json'],
        ['-b 64', 'same flags']),
    'slowed from a crashed run': (
        'dlojz_scaling.py', ['--summary', '{special}/one.json', '--machine', 'a100',
                             '--slowed-from', '{special}/crashed.json'],
        ["'crashed'", 'completed']),
    'pipeline forecast of a FIFO': ('dlojz_scaling.py', ['--pipeline', '{special}/fifo.json'],
                                    ['--pipeline', 'FIFO']),
    'the data folder variable empty': ('dlojz.py', T, ['$DLOJZ_DATA_DIR is set but empty'],
                                       {'DLOJZ_DATA_DIR': ''}),
    # dlojz_bench.py
    'bench corpus of no image': ('dlojz_bench.py', 'corpus {new} --images 0'.split(),
                                 ['--images']),
    'bench a core not ours': ('dlojz_bench.py', 'compare {synth} --cpu 4096'.split(),
                              ['--cpu 4096']),
    'bench unknown pipeline': ('dlojz_bench.py', ['compare', '{synth}', '--pipelines',
                                                  'classic,turbo'], ['turbo']),
    # dlojz_export.py
    'export a summary as a checkpoint': ('dlojz_export.py',
                                         ['{run}/summary.json', '--out', '{new}'],
                                         ['summary.json cannot be read']),
    'export a checkpoint that is not there': ('dlojz_export.py', ['{new}.pt', '--out', '{new}'],
                                              ['new.pt does not exist']),
    'export a sharded checkpoint without its metadata': (
        'dlojz_export.py', ['{cut}', '--out', '{new}'], ['checkpoint-00000002.dcp cannot be read']),
    'export at zero pixels': ('dlojz_export.py', ['{cut}', '--out', '{new}', '--image-size', '0'],
                              ['--image-size', 'got 0']),
    'export into a missing folder': ('dlojz_export.py', ['{cut}', '--out', '{new}/x/y.pt2'],
                                     ['--out', 'does not exist']),
    # dlojz_report.py
    'report comm steps zero': ('dlojz_report.py', '{run} --out {new} --comm-steps 0'.split(),
                               ['--comm-steps']),
}


@pytest.mark.parametrize('case', CASES)
def test_a_bad_input_is_one_sentence_and_changes_nothing(case, written, tmp_path, cache_dir):
    root, synth = written
    script, argv, words, *env = CASES[case]
    paths = {'run': root / 'run', 'shards': root / 'shards', 'damaged': root / 'damaged',
             'odd': root / 'odd' / 'summary.json', 'special': root / 'special',
             'escaping': root / 'escaping', 'fifo_index': root / 'fifo-index',
             'cut': root / 'cut' / 'checkpoint-00000002.dcp',
             'sharded': root / 'sharded' / 'checkpoint-00000002.dcp',
             'synth': synth, 'new': tmp_path / 'new', 'cache': cache_dir}
    argv = [a.format(**paths) if isinstance(a, str) else a for a in argv]
    env = {k: v.format(**paths) for k, v in (env[0] if env else {}).items()}
    before = tree(root, synth)
    r = run(script, *argv, env=env)
    refused(r, words)
    assert tree(root, synth) == before
    assert not os.path.exists(paths['new']), os.listdir(paths['new'])


# Round 4 (issue 49): a damaged file that dlojz answers as its docs promise, not with a refusal. The
# kept dataset index: a new listing and a note, summary.json saying no kept index was used, and the
# same images as the first run listed. -> (change to the index, the words of the note)
INDEX_DAMAGE = {
    'train as a list': (lambda kept: kept['splits'].update(train=[]), ['splits.train']),
    'a class without files': (lambda kept: first(kept).pop('files'), ['files']),
    'a class that is null': (lambda kept: kept['splits']['train'].update(
        {next(iter(kept['splits']['train'])): None}), ['null']),
    'numbers as file names': (lambda kept: first(kept).update(files=[1, 2]), ['the number 1']),
    'a text as the file list': (lambda kept: first(kept).update(files='cat.jpg'), ['the text']),
    'a name out of its class folder': (
        lambda kept: first(kept)['files'].append('../../val/n00000001/x.JPEG'), ['../../val']),
    'no splits': (lambda kept: kept.update(splits=[]), ['splits']),
    'a FIFO': (None, ['is a FIFO, not a file']),
    'intact': (lambda kept: None, None),  # the control: kept, no note
}


def first(kept):
    """The first training class folder's entry of a kept index."""
    train = kept['splits']['train']
    return train[next(iter(train))]


@pytest.fixture(scope='module')
def data_folder(written, tmp_path_factory):
    """A data folder of the user's (a copy of the synthetic one) and the training images its first
    run listed."""
    data = tmp_path_factory.mktemp('data') / 'imgs'
    shutil.copytree(written[1], data)
    return data


@pytest.mark.parametrize('damage', INDEX_DAMAGE)
def test_a_damaged_index_is_listed_again_with_a_note(damage, data_folder, tmp_path):
    cache = tmp_path / 'cache'
    argv = [*TINY, '--test-nsteps', '1', '--data-dir', data_folder, '--cache-dir', cache]
    r = run('dlojz.py', *argv, '--output-dir', tmp_path / 'first')
    assert r.returncode == 0, r.stderr[-2000:]
    path, = (cache / 'index').glob('*.json')
    change, words = INDEX_DAMAGE[damage]
    if change is None:
        os.remove(path)
        os.mkfifo(path)
    else:
        kept = json.loads(path.read_text())
        change(kept)
        path.write_text(json.dumps(kept))
    r = run('dlojz.py', *argv, '--output-dir', tmp_path / 'again')
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'Traceback' not in r.stdout + r.stderr
    note = [line for line in r.stdout.splitlines() if 'Note: the dataset index' in line]
    summaries = [json.loads((tmp_path / d / 'summary.json').read_text())
                 for d in ('first', 'again')]
    if words is None:
        assert not note and summaries[1]['data']['index']['kept_index'] is True
        return
    assert len(note) == 1 and 'listed again' in note[0], r.stdout[-3000:]
    for w in words:
        assert w in note[0], (w, note[0])
    assert summaries[0]['data']['index']['kept_index'] is False  # the first listing
    assert summaries[1]['data']['index']['kept_index'] is False
    assert summaries[0]['data']['train_images'] == summaries[1]['data']['train_images']
