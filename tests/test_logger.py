"""One logger: each record of a real run (train, train_metrics, val) reaches the console line, metrics.jsonl
and wandb from the same dict. The console's numbers are read back from stdout with regular expressions
and must equal the JSONL values at the printed precision; wandb (a fake with wandb's log/finish names)
must get exactly the JSONL values at the record's global step.

Run: python -m pytest -q tests/test_logger.py
"""
import json
import re

import pytest

from conftest import TINY
import dlojz
from dlojzlib.record.log import Console, Logger
from test_exits import FakeWandb

NUM = r'(-?[0-9.]+)'
PATTERNS = {  # type -> (regex over a console line, the record keys it prints, in order, with their decimals)
    'train': (rf'epoch (\d+)/\d+ step (\d+)/\d+ loss {NUM} lr {NUM} \| step {NUM} ms data {NUM} ms \| {NUM} img/s',
              [('epoch', 0), ('step', 0), ('loss', 4), ('lr', 5), ('step_ms', 1), ('data_ms', 1), ('img_s', 1)]),
    'train_metrics': (rf'Train metrics at step (\d+): loss {NUM} top-1 {NUM} top-5 {NUM}',
                      [('step', 0), ('loss', 4), ('top1', 4), ('top5', 4)]),
    'val': (rf'Validation epoch (\d+): loss {NUM} top-1 {NUM} top-5 {NUM} \((\d+) images',
            [('epoch', 0), ('loss', 4), ('top1', 4), ('top5', 4), ('images', 0)]),
}


def test_console_jsonl_and_wandb_get_the_same_numbers(tmp_path, cache_dir, monkeypatch, capsys):
    wandb = FakeWandb()
    monkeypatch.setattr(dlojz, 'build_wandb', lambda args, dist: wandb)
    argv = [*TINY, '--cache-dir', cache_dir, '--output-dir', str(tmp_path), '--test-nsteps', '4', '--log-interval',
            '1', '--metric-step', '2', '--wandb', 'offline']
    dlojz.main(dlojz.get_args_parser().parse_args(argv))
    out = capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert [r['type'] for r in records] == ['train', 'train', 'train_metrics', 'train', 'train', 'train_metrics', 'val']
    for kind, (pattern, keys) in PATTERNS.items():
        printed = re.findall(pattern, out)
        logged = [r for r in records if r['type'] == kind]
        assert len(printed) == len(logged) > 0, kind
        for values, rec in zip(printed, logged):
            for text, (key, decimals) in zip(values, keys):
                assert text == f'{rec[key]:.{decimals}f}', (kind, key)
    # wandb: every record, once, same numbers, at its global step
    assert len(wandb.logged) == len(records)
    for (step, numbers), rec in zip(wandb.logged, records):
        assert step == rec['global_step']
        expected = {f"{rec['type']}/{k}": v for k, v in rec.items() if k not in ('type', 'epoch', 'step', 'global_step')}
        assert numbers == expected
    assert wandb.exit_code == 0


def test_only_rank_0_writes(tmp_path, capsys):
    lines = {'train': lambda r: f"loss {r['loss']}"}
    rank1 = Logger(tmp_path / 'm.jsonl', Console(enabled=False), lines=lines)
    rank1.print('hello')
    rank1.log(type='train', global_step=1, loss=1.0)
    rank1.close()
    assert not (tmp_path / 'm.jsonl').exists() and capsys.readouterr().out == ''


@pytest.mark.parametrize('append, expected', [(False, 1), (True, 2)])
def test_resumed_runs_append(tmp_path, append, expected):
    for mode in (False, append):
        log = Logger(tmp_path / 'm.jsonl', Console(tty=False), append=mode)
        log.log(type='train', global_step=1, loss=1.0)
        log.close()
    assert len(open(tmp_path / 'm.jsonl').readlines()) == expected
