"""Flags: the parser refuses bad values with one sentence (exit 2, no usage block); check_args
resolves the learning rate by the linear scaling rule (hand-computed values), keeps --lr as an
override, and adds no attribute the parser does not define. Every flag has a help text. `python
dlojz.py` answers --help, a bad flag and a refused flag combination without importing torch (seconds
on a loaded node), checked in a fresh interpreter that runs the script's own entry path.

Run: python -m pytest -q tests/test_flags.py"""
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
import dlojz
from dlojzlib import flags
from dlojzlib.errors import UsageError

CPU = torch.device('cpu')


def resolved(*argv, world_size=1):
    args = dlojz.get_args_parser().parse_args([str(a) for a in argv])
    return flags.check_args(args, CPU, world_size)


@pytest.mark.parametrize('argv, sentence', [
    (['-b', '0'], '-b/--batch-size must be positive (got 0)'),
    (['-b', '1.5'], '-b/--batch-size must be an integer (got 1.5)'),
    (['--num-workers', '-1'], '--num-workers must be 0 or more (got -1)'),
    (['--lr', 'nan'], '--lr must be positive (got nan)'),
    (['--wd', '-0.1'], '--wd must be 0 or more (got -0.1)'),
    (['--label-smoothing', '1'], '--label-smoothing must be in [0, 1) (got 1)'),
    (['--n-heads', '1'], '--n-heads must be at least 2'),
    (['--amp', 'fp8'], "--amp invalid choice: 'fp8'"),
])
def test_bad_values_are_one_sentence(argv, sentence, capsys):
    with pytest.raises(SystemExit) as e:
        dlojz.get_args_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1 and err.startswith('dlojz: error: ') and sentence in err, err


@pytest.mark.parametrize('argv, world_size, lr', [
    ([], 1, 0.1 * 128 / 256),                        # the default batch of 128 on one device: 0.05
    (['-b', '16'], 1, 0.1 * 16 / 256),               # the README demo: 0.00625
    (['-b', '128'], 32, 0.1 * 4096 / 256),           # the course's race, 32 GPUs: 1.6
    (['-b', '16', '--base-lr', '0.2'], 2, 0.2 * 32 / 256),
    (['--optimizer', 'adamw', '-b', '64'], 4, 0.001 * 256 / 256),
    (['-b', '16', '--lr', '0.3'], 8, 0.3),           # explicit override
    (['--findlr'], 1, 10.0),                         # the sweep's default upper end
    (['--findlr', '--lr', '1'], 1, 1.0),
])
def test_learning_rate_follows_the_global_batch(argv, world_size, lr):
    assert resolved(*argv, world_size=world_size).lr == pytest.approx(lr)


def test_check_args_adds_no_attribute():
    parsed = dlojz.get_args_parser().parse_args([])
    before = set(vars(parsed))
    assert set(vars(flags.check_args(parsed, CPU))) == before


def test_cpu_defaults_and_test_mode():
    a = resolved('--test-nsteps', 7, '--num-workers', 3)
    assert (a.test, a.test_nsteps, a.amp, a.pin_memory, a.channels_last) == (True, 7, 'off', False, False)
    assert (a.prefetch_factor, a.persistent_workers, a.wandb) == (2, True, 'off')
    assert resolved('--test').test_nsteps == 50
    assert (resolved('--image-size', 64).val_image_size, resolved('--image-size', 64).val_resize) == (64, 73)


def test_no_abbreviations_and_help_shows_defaults(capsys):
    """--num-work was read as --num-workers; --help shows each default and ends with examples."""
    with pytest.raises(SystemExit) as e:
        dlojz.get_args_parser().parse_args(['--num-work', '1'])
    assert e.value.code == 2 and 'unrecognized arguments: --num-work 1' in capsys.readouterr().err
    text = dlojz.get_args_parser().format_help()
    text = text[text.index('options:'):]
    for flag, default in (('--image-size', 224), ('--epochs', 1), ('--wd', 0.0), ('--seed', 123),
                          ('--batch-size', 128)):
        block = text[text.index(flag):]
        assert f'(default: {default})' in block[:block.index('\n  -')], flag
    assert text.rstrip().splitlines()[-1].endswith('continue a run')


def test_every_flag_has_help():
    missing = [a.option_strings[-1] for a in dlojz.get_args_parser()._actions if a.option_strings and not a.help]
    assert missing == []


# A fresh interpreter runs dlojz.py as `python dlojz.py` would (runpy, __main__), then says whether
# torch was imported on the way: the answer must come before the seconds torch takes to import.
ENTRY = """
import runpy, sys
sys.argv = ['dlojz.py'] + sys.argv[1:]
try:
    runpy.run_path('dlojz.py', run_name='__main__')
except SystemExit as e:
    code = e.code
else:
    code = 'ran'
print('EXIT', code, 'torch' in sys.modules, 'torchvision' in sys.modules, 'numpy' in sys.modules)
"""


@pytest.mark.parametrize('argv, code, words', [
    (['--help'], 0, 'continue a run'),
    (['--num-work', '1'], 2, 'unrecognized arguments: --num-work 1'),
    (['-b', '0'], 2, '-b/--batch-size must be positive (got 0)'),
    (['--evaluate'], 2, '--evaluate validates a trained model'),        # a combination check_flags refuses
    (['--arch', 'resnet51'], 2, 'unknown --arch resnet51'),
    (['--randaugment', '2'], 2, '--randaugment takes N,M'),
])
def test_usage_answers_come_before_torch(argv, code, words):
    r = subprocess.run([sys.executable, '-c', ENTRY, *argv], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.stdout.rstrip().splitlines()[-1] == f'EXIT {code} False False False', r.stdout[-2000:] + r.stderr
    assert words in r.stdout + r.stderr and 'Traceback' not in r.stderr
    if code == 2:  # one sentence, as check_args says it in-process
        assert r.stderr.count('\n') == 1 and r.stderr.startswith('dlojz: error: '), r.stderr


def test_check_flags_and_check_args_refuse_alike(capsys):
    """The early check (torch-free) and cli() in-process give the same line and exit code."""
    assert dlojz.cli(['--evaluate']) == 2
    assert capsys.readouterr().err == ('dlojz: error: --evaluate validates a trained model; give its checkpoint '
                                       'with --resume PATH.\n')


def test_resume_auto_needs_a_run_folder():
    """Outside a SLURM job the default folder is new each time (a timestamp): --resume auto would
    silently start afresh. A run name, an output dir or a SLURM job id (a requeued job keeps its id,
    hence its folder) name it."""
    with pytest.raises(UsageError, match='--resume auto continues the run of --output-dir or --run-name'):
        resolved('--resume', 'auto')
    parse = lambda *a: dlojz.get_args_parser().parse_args(['--resume', 'auto', *a])
    assert flags.check_args(parse('--output-dir', 'runs/x'), CPU).resume == 'auto'
    assert flags.check_args(parse('--run-name', 'x'), CPU).resume == 'auto'
    assert flags.check_args(parse(), CPU, job_id='4242').resume == 'auto'
    # the slurm/ scripts pass it to every run
    assert flags.check_args(parse('--loader-only'), CPU).resume is None


def test_the_environment_dlojz_reads_is_checked():
    """Issue 40: a DLOJZ_ variable with a misspelt name or value, or OMP_NUM_THREADS that is not a
    number, was ignored (OpenMP ignores a bad value too); each is one sentence naming it."""
    from dlojzlib.errors import UsageError
    ok = {'DLOJZ_HANDOVER': 'default', 'DLOJZ_REGION_DECODE': '0', 'DLOJZ_MASTER_SUFFIX': '-ib0',
          'DLOJZ_RUN': 'my run', 'OMP_NUM_THREADS': '4', 'PATH': '/bin',
          'DLOJZ_DATA_DIR': '/anywhere'}
    flags.check_environment(ok)
    for env, words in (({'DLOJZ_DATADIR': '/x'}, 'DLOJZ_DATADIR is set, but dlojz reads no such'),
                       ({'DLOJZ_HANDOVER': 'defualt'}, "DLOJZ_HANDOVER='defualt' is not a value"),
                       ({'DLOJZ_REGION_DECODE': 'off'}, 'it takes 0 or 1'),
                       ({'DLOJZ_MASTER_SUFFIX': '-ib0; rm -rf'}, 'DLOJZ_MASTER_SUFFIX'),
                       ({'OMP_NUM_THREADS': '0'}, 'OMP_NUM_THREADS'),
                       ({'OMP_NUM_THREADS': 'four'}, 'positive')):
        with pytest.raises(UsageError, match=re.escape(words)):
            flags.check_environment({**ok, **env})


def test_an_lr_sweep_must_go_up():
    """Issue 40: --findlr --lr 1e-9 swept from 1e-8 down to 1e-9 and suggested a rate from it."""
    from dlojzlib.errors import UsageError
    with pytest.raises(UsageError, match=r'--findlr sweeps the learning rate up from 1e-8 to --lr'):
        flags.check_flags(flags.get_args_parser().parse_args(['--findlr', '--lr', '1e-9']))
    flags.check_flags(flags.get_args_parser().parse_args(['--findlr', '--lr', '1']))


def test_a_full_run_without_wandb_trains_and_asking_for_it_is_one_sentence(tmp_path, cache_dir,
                                                                            monkeypatch):
    """The GPU node has no wandb: a full run (not --test-nsteps) defaulted to --wandb offline and
    crashed at its start on the import (issue 45). Without the package the default is off, recorded in
    config.json, and the run trains; asking for wandb by name is refused in one sentence before any
    work."""
    from conftest import TINY
    monkeypatch.setitem(sys.modules, 'wandb', None)  # not importable, as on the node
    argv = [a for a in TINY if a not in ('--wandb', 'off')] + ['--cache-dir', cache_dir, '-e', '1']
    with pytest.raises(UsageError, match=r'^--wandb offline needs the wandb package, .*pass --wandb off\.$'):
        resolved(*argv, '--wandb', 'offline')
    summary = dlojz.main(dlojz.get_args_parser().parse_args([*argv, '--output-dir', str(tmp_path)]))
    assert summary['status'] == 'completed' and summary['config']['wandb'] == 'off'


@pytest.mark.parametrize('mode, world_size, refused', [
    ('reduce-overhead', 2, True), ('max-autotune', 4, True), ('reduce-overhead', 1, False),
    ('max-autotune-no-cudagraphs', 2, False), ('default', 2, False)])
def test_cuda_graph_modes_are_refused_under_ddp(mode, world_size, refused):
    """The compile modes that capture CUDA graphs, with several processes (DDP): torch's own trackers
    say they give nothing or fail there (pytorch/pytorch#139207, #140395): one sentence before the
    run, naming the modes that work."""
    argv = ['--compile', '--compile-mode', mode]
    if not refused:
        resolved(*argv, world_size=world_size)
        return
    with pytest.raises(UsageError, match=rf'^--compile-mode {mode} captures CUDA graphs, which DDP defeats .*'
                                         r'use --compile-mode default or max-autotune-no-cudagraphs\.$'):
        resolved(*argv, world_size=world_size)
