"""dlojzlib.lightning: the Chronometer callback and the DataModule in Lightning runs on CPU.

- Lightning absent: `import dlojzlib.lightning` and the example each say in one sentence what to
  install; nothing else in dlojz imports Lightning.
- The callback's verdicts in the regimes they name, the cause outside the code: a loader that sleeps
  (loader-bound), a training step that sleeps (compute-bound), with any DataModule and with dlojz's
  (its loader's own wait, from the slow-loader failpoint); its steps tile the training's wall time,
  measured by a second callback.
- Its record reads as dlojz.py's: the same '>>>' lines in the same order, the same summary.json
  timing entries, the report reads both.
- 2 processes (gloo, slow): one summary.json with both ranks and the timed all-reduce; rank 0 alone
  writes metrics.jsonl; the losses with and without the callback are the same at 1 and 2
  processes; the DataModule's validation at 1 and 2 processes counts every image once and agrees.

Run: python -m pytest -q tests/test_lightning.py (the slow ones: -m slow)"""
import ast
import csv
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from test_layout import modules

pl = pytest.importorskip('lightning.pytorch', reason='Lightning is optional: '
                         'pip install -r requirements-lightning.txt')
import torch  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dlojzlib.errors import UsageError  # noqa: E402
from dlojzlib.lightning import Chronometer, ImageFolderDataModule  # noqa: E402
from dlojzlib.lightning.datamodule import data_flags  # noqa: E402

EXAMPLE = os.path.join(ROOT, 'examples', 'lightning_resnet50.py')
# TINY's data (conftest), as the example's DataModule flags
DATA = ['--data-flag=--synthetic-classes=4', '--data-flag=--synthetic-train-per-class=24',
        '--data-flag=--synthetic-val-per-class=6', '--data-flag=--val-resize=36',
        '--data-flag=--val-image-size=32', '--data-flag=--val-batch-size=16']
SMALL = ['--arch', 'resnet18', '--image-size', '32', '-b', '8', '--num-workers', '0',
         '--accelerator', 'cpu']


def example(*argv):
    """The example's main(), in this process: -> the Trainer."""
    spec = importlib.util.spec_from_file_location('lightning_resnet50', EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(mod.get_args_parser().parse_args([str(a) for a in argv]))


def run_example(*argv, env=None, timeout=300):
    return subprocess.run([sys.executable, EXAMPLE, *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def record(out):
    with open(os.path.join(out, 'summary.json')) as f:
        summary = json.load(f)
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        return summary, [json.loads(line) for line in f]


# ---------------------------------------------------------------------------- Lightning absent
HIDE = ('import sys; sys.modules["lightning"] = None; ')  # as if it were not installed


def test_without_lightning_the_import_says_what_to_install():
    p = subprocess.run([sys.executable, '-c', HIDE + 'import dlojzlib.lightning'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last == ('ModuleNotFoundError: dlojzlib.lightning needs PyTorch Lightning 2.x, which '
                    'this Python does not have: pip install -r requirements-lightning.txt')


def test_without_lightning_the_example_exits_with_one_sentence(tmp_path):
    script = tmp_path / 'run.py'
    script.write_text(HIDE + f'sys.argv = ["x"]; exec(compile(open({EXAMPLE!r}).read(), '
                      f'{EXAMPLE!r}, "exec"), {{"__file__": {EXAMPLE!r}, "__name__": "__main__"}})')
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and 'Traceback' not in p.stderr
    assert p.stderr.strip() == ('lightning_resnet50: error: dlojzlib.lightning needs PyTorch '
                                'Lightning 2.x, which this Python does not have: pip install -r '
                                'requirements-lightning.txt')


def test_nothing_but_its_package_imports_lightning():
    """dlojz runs without Lightning: only dlojzlib/lightning (and the example) import it."""
    importers = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ''] if isinstance(node, ast.ImportFrom) else []
            if any(n.split('.')[0] in ('lightning', 'pytorch_lightning') or
                   n.startswith('dlojzlib.lightning') for n in names):
                importers.add(name)
    assert importers and all(m.startswith('dlojzlib.lightning') for m in importers), importers


# ------------------------------------------------------------------------ the DataModule's flags
@settings(max_examples=100, deadline=1000)
@given(data_dir=st.none() | st.text(max_size=12), batch=st.integers(-2, 10**6),
       workers=st.none() | st.integers(-2, 64),
       flags=st.lists(st.sampled_from(['--image-size', '--decode', 'gpu', '--accum-steps', '2',
                                       '--bogus', '-1', 'x', '--seed', '=']) | st.text(max_size=6),
                      max_size=4))
def test_any_datamodule_arguments_give_flags_or_one_sentence(data_dir, batch, workers, flags):
    """The DataModule's arguments go through dlojz's parser: its flags, or one UsageError."""
    try:
        args = data_flags(data_dir, batch, workers, flags)
    except UsageError as e:
        assert str(e).startswith('ImageFolderDataModule: ') and '\n' not in str(e)
    else:
        assert args.batch_size == batch > 0 and args.accum_steps == 1 and args.decode != 'gpu'


@pytest.mark.slow  # the input sweep's kind: a subprocess per case
@pytest.mark.parametrize('argv,words', [
    (['-b', '0'], ['--batch-size', 'got 0']),
    (['--data-flag=--accum-steps=2'], ["accumulate_grad_batches"]),
    (['--data-flag=--decode=gpu'], ['--decode gpu is not offered']),
    (['--data-flag=--bogus'], ['unrecognized arguments: --bogus']),
    # round 5 (issue 49): each was a traceback
    (['--arch', 'notanet'], ["'notanet' is not a torchvision classification model"]),
    (['--devices', 'x'], ['--devices', 'got x']),
    (['--lr', 'nan'], ['--lr', 'got nan']),
    (['--warmup-steps', '-3'], ['--warmup-steps', 'got -3']),
    (['--precision', '7'], ["Lightning refuses the Trainer's settings", "Precision '7'"]),
])
def test_the_examples_bad_flags_are_one_sentence(argv, words, tmp_path):
    p = run_example(*argv, '--output-dir', tmp_path / 'new')
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if 'error:' in line]
    assert len(errors) == 1 and all(w in errors[0] for w in words), p.stderr
    assert not (tmp_path / 'new').exists()


@pytest.mark.slow
def test_an_output_folder_that_cannot_be_made_is_one_sentence():
    p = run_example('--max-steps', '1', '--output-dir', '/dev/null/x')
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    assert '--output-dir /dev/null/x cannot be made (Not a directory)' in p.stderr


# ---------------------------------------------------------------------------- verdicts
class Sleepy(pl.LightningModule):
    """A linear model whose training step also sleeps `compute_s` (host time, as a kernel would
    take on a CPU)."""

    def __init__(self, compute_s):
        super().__init__()
        self.compute_s = compute_s
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch):
        time.sleep(self.compute_s)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SlowData(torch.utils.data.Dataset):
    def __init__(self, per_item_s, n=96):
        self.per_item_s, self.n = per_item_s, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.per_item_s)
        return torch.full((8,), float(i)), i % 2


class Tiles(pl.Callback):
    """A second clock: the training's wall time from the epoch's start to the last step's end."""

    def on_train_epoch_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.t1 = time.perf_counter()


def fit_sleepy(tmp_path, compute_s, per_item_s):
    chrono, tiles = Chronometer(str(tmp_path / 'rec'), warmup_steps=2), Tiles()
    trainer = pl.Trainer(max_epochs=1, accelerator='cpu', devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[chrono, tiles], log_every_n_steps=4,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(SlowData(per_item_s), batch_size=8)
    trainer.fit(Sleepy(compute_s), train_dataloaders=loader)
    return chrono, tiles, record(tmp_path / 'rec')


def test_a_loader_that_sleeps_is_named_the_bound(tmp_path):
    chrono, tiles, (summary, _) = fit_sleepy(tmp_path, 0.002, 0.005)  # 40 ms per batch
    t = summary['timing']
    assert t['bound'] == 'loader' and t['shares']['loader'] > 0.6, t['shares']
    assert 0.040 <= t['stats']['data']['median'] < 0.080  # the sleep, and Lightning's own time
    assert summary['lightning']['data_wait'] == 'between steps'
    assert any('on_train_batch_start' in s for s in summary['lightning']['unseen'])


def test_a_training_step_that_sleeps_is_named_the_bound(tmp_path):
    chrono, tiles, (summary, _) = fit_sleepy(tmp_path, 0.040, 0.0)
    t = summary['timing']
    assert t['bound'] == 'compute' and t['shares']['compute'] > 0.8, t['shares']
    assert 0.040 <= t['stats']['forward']['median'] < 0.080  # the sleep is in training_step
    assert t['phase_sum_error'] == 0.0
    # the steps tile the time between the epoch's start and the last step's end
    steps = sum(r['step'] for r in chrono.chrono.steps)
    assert steps == pytest.approx(tiles.t1 - tiles.t0, rel=0.02)
    assert summary['lightning']['callback_share'] < 0.01  # its own hooks' time


def test_the_datamodules_own_loader_wait_is_the_data_wait(tmp_path):
    """slow-loader: 50 ms per image in the loader (failpoints), 8 images a batch: the data wait is
    the loader's 400 ms, measured by the DataModule's stamps (SGD: a step's work well below it,
    even on a loaded machine)."""
    out = tmp_path / 'run'
    p = run_example(*SMALL, *DATA, '--max-steps', '8', '--max-epochs', '1', '--output-dir', out,
                    '--data-flag=--cache-dir=' + str(tmp_path / 'cache'), '--warmup-steps', '2',
                    '--optimizer', 'sgd', env={'DLOJZ_FAULT': 'slow-loader:0:0.05'})
    assert p.returncode == 0, p.stderr[-3000:]
    summary, _ = record(out / 'dlojz')
    t = summary['timing']
    assert summary['lightning']['data_wait'] == 'loader'
    # the loader's 400 ms, and none of the step's own work (under load both grow)
    st = t['stats']
    assert 0.400 <= st['data']['median'] < st['step']['median'] - st['forward']['median']
    assert t['stats']['h2d']['median'] > 0  # the DataModule's copy, a phase of its own
    assert t['bound'] == 'loader'


# ---------------------------------------------------------------------------- as dlojz.py's
def lines_of(text):
    return [line.split(':')[0] for line in text.splitlines() if line.startswith('>>>')]


def test_the_record_reads_as_dlojz_pys(tmp_path, cache_dir):
    """The same model, data and batch through dlojz.py and through the example: the same '>>>'
    lines in the same order, the same timing entries, and the report reads both."""
    from conftest import TINY, run_cli
    ours = tmp_path / 'dlojz_py'
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', ours, '--test-nsteps', '12',
                '--optimizer', 'adamw', '--wd', '0')
    assert p.returncode == 0, p.stderr[-3000:]
    theirs = tmp_path / 'lightning'
    q = run_example(*SMALL, *DATA, '--max-epochs', '1', '--output-dir', theirs,
                    '--data-flag=--cache-dir=' + cache_dir, '--log-every-n-steps', '4')
    assert q.returncode == 0, q.stderr[-3000:]
    a, b = record(ours)[0], record(theirs / 'dlojz')[0]
    # dlojz.py's header; what only it measures (the start-up, the model states) keeps its line,
    # which says why it is not measured
    dropped = {'>>> Training on 1 node and 1 process'}
    assert lines_of(q.stdout) == [x for x in lines_of(p.stdout) if x not in dropped]
    for name in ('Memory', 'Start-up'):
        assert f'>>> {name}: not measured: this training loop does not measure it' in q.stdout
    assert set(a['timing']) - set(b['timing']) <= {'full_val_time_estimate_s'}
    assert a['timing']['stats'].keys() == b['timing']['stats'].keys()
    assert b['timing']['steps'] == 12 and b['global_batch'] == 8
    report = subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_report.py'), str(ours),
                             str(theirs / 'dlojz'), '--out', str(tmp_path / 'report')],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert report.returncode == 0, report.stderr
    rows = [line.split() for line in report.stdout.splitlines() if 'completed' in line.split()]
    assert sorted(r[0] for r in rows) == ['dlojz', 'dlojz_py'], report.stdout


# ---------------------------------------------------------------------------- 2 processes
def csv_losses(out):
    """training_loss of every step, from Lightning's CSVLogger (the plain form's own record)."""
    path, = glob.glob(os.path.join(out, 'lightning_logs', 'version_*', 'metrics.csv'))
    with open(path) as f:
        return [(int(r['step']), float(r['training_loss'])) for r in csv.DictReader(f)
                if r.get('training_loss')]


@pytest.mark.slow
@pytest.mark.parametrize('devices', [1, 2])
def test_the_chronometer_changes_no_loss(tmp_path, cache_dir, devices):
    """The seed's script with and without the callback: the same loss at every step."""
    losses = []
    for flag in ([], ['--no-chronometer']):
        out = tmp_path / ('plain' if flag else 'timed')
        p = run_example(*SMALL, *DATA, '--max-epochs', '1', '--output-dir', out, '--devices',
                        devices, '--strategy', 'ddp' if devices > 1 else 'auto',
                        '--log-every-n-steps', '1', '--data-flag=--cache-dir=' + cache_dir, *flag)
        assert p.returncode == 0, p.stderr[-3000:]
        losses.append(csv_losses(out))
    assert len(losses[0]) == 96 // (8 * devices) and losses[0] == losses[1]


@pytest.mark.slow
def test_two_processes_give_one_record_with_every_rank(tmp_path, cache_dir):
    out = tmp_path / 'run'
    p = run_example(*SMALL, *DATA, '--max-epochs', '1', '--output-dir', out, '--devices', '2',
                    '--strategy', 'ddp', '--log-every-n-steps', '2',
                    '--data-flag=--cache-dir=' + cache_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    summary, records = record(out / 'dlojz')
    t = summary['timing']
    assert summary['world_size'] == 2 and summary['global_batch'] == 16
    assert sorted(r['rank'] for r in t['ranks']) == [0, 1]
    assert t['bound_job'] and t['comm_measured'] == 'all-reduce hook'
    assert all(r['comm_steps'] == r['steady_steps'] > 0 for r in t['ranks'])
    # ResNet-18 with 4 classes: 11,178,564 parameters of 4 bytes
    assert summary['communication']['gradient_bytes_per_step'] == 4 * 11_178_564
    train = [r['global_step'] for r in records if r['type'] == 'train']
    assert train == list(range(2, 7, 2))  # 6 steps, a record every 2, written once
    assert p.stdout.count('>>> Bound by:') == 1


VALIDATE = '''
import json, os, sys
sys.argv = [sys.argv[0]] + sys.argv[1:]
import lightning.pytorch as pl
spec = __import__('importlib.util').util.spec_from_file_location('ex', {example!r})
ex = __import__('importlib.util').util.module_from_spec(spec); spec.loader.exec_module(ex)
from dlojzlib.lightning import ImageFolderDataModule
pl.seed_everything(0)
dm = ImageFolderDataModule(None, 8, 0, flags={flags!r})
model = ex.resnet50Model('resnet18')
trainer = pl.Trainer(accelerator='cpu', devices=int(sys.argv[1]),
                     strategy='ddp' if sys.argv[1] != '1' else 'auto', logger=False,
                     enable_progress_bar=False)
import torch


class Count(pl.Callback):  # the images each rank validated, added over the ranks
    n = 0

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, idx=0):
        self.n += len(batch[1])

    def on_validation_end(self, trainer, module):
        n = torch.tensor(self.n)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(n)
        self.n = int(n)


count = Count()
trainer.callbacks.append(count)
res = trainer.validate(model, datamodule=dm)
if trainer.is_global_zero:
    json.dump({{**res[0], 'images': count.n}}, open(sys.argv[2], 'w'))
from dlojzlib.dist import launch  # gloo's threads joined before the interpreter's exit
launch.cleanup(synchronize=True)
'''


@pytest.mark.slow
def test_the_datamodule_validates_every_image_once_at_1_and_2_processes(tmp_path, cache_dir):
    # 3 classes x 5 images: 15, which 2 ranks cannot share evenly (a padded sampler counts 16)
    flags = ['--synthetic-classes', '3', '--synthetic-train-per-class', '8',
             '--synthetic-val-per-class', '5', '--val-resize', '36', '--val-image-size', '32',
             '--val-batch-size', '4', '--image-size', '32', '--cache-dir', cache_dir]
    script = tmp_path / 'validate.py'
    script.write_text(VALIDATE.format(example=EXAMPLE, flags=flags))
    results = []
    for n in (1, 2):
        p = subprocess.run([sys.executable, str(script), str(n), str(tmp_path / f'{n}.json')],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        results.append(json.load(open(tmp_path / f'{n}.json')))
    one, two = results
    assert one['images'] == two['images'] == 15  # every validation image, once
    assert two['val_loss'] == pytest.approx(one['val_loss'], rel=1e-6)
    assert two['val_top1'] == one['val_top1']
