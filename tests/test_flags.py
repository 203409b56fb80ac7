"""Flags: the parser refuses bad values with one sentence (exit 2, no usage block); check_args resolves the
learning rate by the linear scaling rule (hand-computed values), keeps --lr as an override, and adds no
attribute the parser does not define.

Run: python -m pytest -q tests/test_flags.py
"""
import pytest
import torch

import dlojz

CPU = torch.device('cpu')


def resolved(*argv, world_size=1):
    return dlojz.check_args(dlojz.get_args_parser().parse_args([str(a) for a in argv]), CPU, world_size)


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
    assert set(vars(dlojz.check_args(parsed, CPU))) == before


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
