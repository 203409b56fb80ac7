"""A run extended with another global batch (--allow-batch-change) or at another world size
(record.state: restore, check_resume; issue 57): the position is put where the new loader's steps
say, and the rebuilt LR schedule ends at the run's last step.

- A property test over the scheduler, the world size before and after, -b, --accum-steps,
  --drop-last, --warmup-epochs, the dataset's size, the epochs before and after (and --test-nsteps),
  on a single nn.Linear with the optimizer and scheduler recipe.build_optimization builds: a
  checkpoint written by the first run at an epoch's end or mid-epoch is restored into the second.
  The steps per epoch come from the loaders' own classes (StepBatchSampler, FakeLoader,
  Accumulate); the steps the resumed run takes from the training loop's rule (dlojz.train and
  close_epoch, restated below). Then: the restored step is the batch holding the first image not
  yet seen; the schedule covers exactly the run's steps; stepping it through them raises nothing;
  the LR of the last step is the LR a schedule built afresh for the run's length gives at its last
  step; a run that ends before the checkpoint is refused (check_resume) and one that does not is
  not.
- Real runs of 100 images (epochs that do not divide evenly) extended from 1 epoch to 2 with
  --allow-batch-change complete, their last step at the end of their schedule: 2 ranks under
  --shard full -> 1 process (issue 57's crash at the last step: 7 steps of 16 images had become 14
  steps of 8, and 14 + 13 overran the 26 of the rebuilt one-cycle); in the long tier 2 -> 1,
  1 -> 3 and 2 -> 1 under --shard full, each under onecycle, cosine and poly, and a pipeline of 2
  stages resumed with 1 replica instead of 2.

Run: python -m pytest -q tests/test_extend.py    (the matrix and the pipeline: -m slow)"""
import json
import os
import random
import tempfile
import warnings
from argparse import Namespace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import assume, event, given, settings, strategies as st

from conftest import TINY, run_cli, torchrun
import dlojz
from dlojzlib import choices, flags, recipe
from dlojzlib.data.datasets import Accumulate, FakeLoader, StepBatchSampler
from dlojzlib.dist import plan
from dlojzlib.errors import UsageError
from dlojzlib.record import state

TORCH = tuple(int(v) for v in torch.__version__.split('+')[0].split('.')[:2])
FSDP = pytest.mark.skipif(TORCH < plan.FSDP_TORCH,
                          reason='FSDP2 runs on CPU from torch 2.6 (refused below)')

CPU = torch.device('cpu')
NOWHERE = os.path.join(tempfile.gettempdir(), 'dlojz-test-extend-no-such-run')  # no summary.json


def loader_steps(n_train, batch, world, accum, drop_last, fake):
    """Optimizer steps per epoch as the training loader yields them (data.Data.train_steps)."""
    if fake:  # one stream per rank, its share padded as DistributedSampler pads
        loader = FakeLoader(-(-n_train // world), batch, 1, 2, False, drop_last, 0)
        return len(Accumulate(loader, accum))
    return StepBatchSampler(range(n_train), 0, batch, drop_last, 0, world, accum).steps()


def run_args(scheduler, batch, world, accum, drop_last, warmup, epochs, test_nsteps=None):
    argv = [*TINY, '-b', batch, '--accum-steps', accum, '--scheduler', scheduler,
            '--warmup-epochs', warmup, '-e', epochs, '--image-size', 64,  # -b 1 takes 64 px
            '--resume', 'auto', '--allow-batch-change',
            '--output-dir', NOWHERE, '--drop-last' if drop_last else '--no-drop-last']
    argv += ['--test-nsteps', test_nsteps] if test_nsteps else []
    return flags.check_args(dlojz.get_args_parser().parse_args([str(a) for a in argv]), CPU,
                            world_size=world)


def quiet_steps(scheduler, n):
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no gradients here
        warnings.simplefilter('ignore')
        for _ in range(n):
            scheduler.step()


def checkpoint(args, world, steps, n_train, epoch, step, end_due, recorded):
    """What the first run's checkpoint holds at (epoch, step), its schedule stepped there."""
    model = nn.Linear(2, 2)
    _, optimizer, scheduler, _ = recipe.build_optimization(args, model, steps,
                                                           args.epochs * steps,
                                                           choices.choose('cpu'))
    global_step = epoch * steps + step
    quiet_steps(scheduler, global_step)
    ckpt = {'arch': args.arch, 'num_classes': 2, 'train_images': n_train,
            'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
            'scheduler': scheduler.state_dict(), 'scaler': {}, 'ema': None, 'epoch': epoch,
            'step_in_epoch': step, 'end_due': end_due, 'global_step': global_step,
            'global_batch': args.batch_size * world * args.accum_steps, 'args': vars(args),
            'rng': {'torch': torch.get_rng_state(), 'numpy': np.random.get_state(),
                    'python': random.getstate()}}
    if recorded:  # checkpoints written before issue 57 lack it
        ckpt['steps_per_epoch'] = steps
    return ckpt


def resumed(args, world, steps):
    """A run as record.state.restore reads it: a one-layer model, the recipe's optimizer and
    schedule for `steps` optimizer steps an epoch."""
    model = nn.Linear(2, 2)
    _, optimizer, scheduler, scaler = recipe.build_optimization(
        args, model, steps, args.epochs * steps, choices.choose('cpu'))
    return SimpleNamespace(args=args, model_without_ddp=model, optimizer=optimizer,
                           scheduler=scheduler, scaler=scaler, ema=None, pipe=None,
                           dist=SimpleNamespace(rank=0, world_size=world, is_main=True),
                           device=CPU, global_batch=args.batch_size * world * args.accum_steps,
                           steps_per_epoch=steps, log=SimpleNamespace(print=lambda *a: None),
                           started=0.0, process_started=0.0)


def steps_taken(progress, epochs, steps, test_nsteps=None):
    """The optimizer steps dlojz.train runs from `progress` (train_one_epoch from progress.step to
    the epoch's end or --test-nsteps, then close_epoch)."""
    epoch, step, done, end_due, n = progress.epoch, progress.step, progress.global_step, \
        progress.end_due, 0
    while epoch < epochs:
        if not end_due:
            left = test_nsteps - done if test_nsteps else steps - step
            if left <= 0:
                break
            k = min(steps - step, left)
            n, step, done = n + k, step + k, done + k
        end_due = False
        if step == steps:
            epoch, step = epoch + 1, 0
        if test_nsteps and done >= test_nsteps:
            break
    return n


def last_lr(args, steps):
    """The LR of the last step of a run of args.epochs epochs of `steps` steps, from its schedule
    built afresh and stepped to its end."""
    _, optimizer, scheduler, _ = recipe.build_optimization(
        args, nn.Linear(2, 2), steps, args.epochs * steps, choices.choose('cpu'))
    quiet_steps(scheduler, args.epochs * steps - 1)
    return optimizer.param_groups[0]['lr']


RUNS = st.fixed_dictionaries({
    'scheduler': st.sampled_from(['onecycle', 'cosine', 'poly', 'constant']),
    'warmup': st.sampled_from([0, 0.5, 1, 2]), 'drop_last': st.booleans(), 'fake': st.booleans(),
    'n_train': st.integers(1, 300), 'recorded': st.booleans(),
    # before, after: world size, -b, --accum-steps, -e
    'world': st.tuples(st.integers(1, 4), st.integers(1, 4)),
    'batch': st.tuples(st.integers(1, 16), st.integers(1, 16)),
    'accum': st.tuples(st.integers(1, 3), st.integers(1, 3)),
    'epochs': st.tuples(st.integers(1, 3), st.integers(1, 4)),
    # where the first run's checkpoint is: 'closed' after an epoch's validation, else a step in an
    # epoch (the last one: a checkpoint that owes the epoch's validation)
    'at': st.tuples(st.sampled_from(['closed', 'step']), st.integers(0, 10 ** 6)),
    'test_nsteps': st.none() | st.integers(1, 400)})


@settings(deadline=None, max_examples=150)
@given(RUNS)
def test_the_rebuilt_schedule_ends_at_the_last_step_of_the_run(case):
    (w1, w2), (b1, b2), (a1, a2), (e1, e2) = (case['world'], case['batch'], case['accum'],
                                              case['epochs'])
    n, drop_last, fake = case['n_train'], case['drop_last'], case['fake']
    assume(max(b1 * w1 * a1, b2 * w2 * a2) <= n)  # data.check_fits refuses a larger global batch
    s1, s2 = (loader_steps(n, b, w, a, drop_last, fake) for b, w, a in ((b1, w1, a1), (b2, w2, a2)))
    assume(s1 > 0 and s2 > 0)  # and an epoch without a step
    kind, draw = case['at']
    if kind == 'closed':
        epoch, step, end_due = 1 + draw % e1, 0, False
    else:
        epoch, step = draw % e1, 1 + draw // e1 % s1
        end_due = step == s1
    old = run_args(case['scheduler'], b1, w1, a1, drop_last, case['warmup'], e1)
    ckpt = checkpoint(old, w1, s1, n, epoch, step, end_due, case['recorded'])
    test_nsteps = case['test_nsteps']
    new = run_args(case['scheduler'], b2, w2, a2, drop_last, case['warmup'], e2, test_nsteps)
    run = resumed(new, w2, s2)
    total = min(test_nsteps or e2 * s2, e2 * s2)
    data = SimpleNamespace(classes=['a', 'b'], n_train=n)
    check = lambda: state.check_resume(new, run.dist, 'ckpt', ckpt, data, run.model_without_ddp,
                                       run.optimizer, run.global_batch, s2, total)
    finished = epoch + (step == s1)  # epochs the first run trained to their end
    seen = 0 if step == s1 else step * ckpt['global_batch']  # images of the epoch under way
    # past the run's end (in epochs, then images), where the images left of an epoch that do not
    # fill one of the new loader's steps count as the epoch trained: refused, and only then
    where = (finished + 1, 0) if seen >= s2 * run.global_batch else (finished, seen)
    if where > (total // s2, total % s2 * run.global_batch):
        event('refused: past the end')
        with pytest.raises(UsageError, match='a resumed run cannot end before its checkpoint'):
            check()
        return
    check()
    progress = state.restore(run, ckpt)
    # the epochs trained, and in the epoch under way the batch holding its first image not yet seen
    assert progress.epoch + (progress.step == s2) == where[0]
    if progress.step < s2:
        assert progress.step * run.global_batch <= seen < (progress.step + 1) * run.global_batch
    taken = steps_taken(progress, e2, s2, test_nsteps)
    assert progress.global_step + taken == total  # the schedule covers the run's steps, no more
    lrs = []
    for _ in range(taken):  # the loop's order: the step reads the LR, then the schedule steps
        lrs.append(run.optimizer.param_groups[0]['lr'])
        quiet_steps(run.scheduler, 1)
    event(f'{len(lrs) and "steps run" or "no step left"}, '
          f'{"same" if run.global_batch == ckpt["global_batch"] else "another"} global batch')
    if lrs and total == e2 * s2:
        assert lrs[-1] == pytest.approx(last_lr(new, s2), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize('epochs, at, batch, length, says', [
    # 1 epoch of 12 steps of 8, at step 3 (24 images): 4 steps of 5, and 4 images of the 5th
    ((1, 1), (0, 3), 5, ('--test-nsteps', 4), 'checkpoint ckpt is at step 4 and partway through '
     'step 5 of 5 images but this run ends at step 4: a resumed run cannot end before its '
     'checkpoint; pass --test-nsteps 5 or more to continue it, or --evaluate --resume ckpt to '
     'validate it.'),
    # 2 epochs, at the 2nd's first step (8 images): an epoch of 6 steps of 16 ends before it
    ((2, 1), (1, 1), 16, (), 'checkpoint ckpt is at step 6 and partway through step 7 of 16 '
     'images but this run ends at step 6: a resumed run cannot end before its checkpoint; pass '
     '-e 2 or more to continue it, or --evaluate --resume ckpt to validate it.')])
def test_a_run_ending_inside_the_checkpoints_last_step_is_refused(epochs, at, batch, length, says):
    """96 images, one rank, -b 8 then another: the checkpoint's images can end partway through a
    step of the new batch; a run that ends before that step would end before its checkpoint."""
    old = run_args('cosine', 8, 1, 1, False, 0, epochs[0])
    ckpt = checkpoint(old, 1, 12, 96, *at, False, True)
    new = run_args('cosine', batch, 1, 1, False, 0, epochs[1], *length[1:])
    steps = loader_steps(96, batch, 1, 1, False, False)
    total = min(new.test_nsteps, new.epochs * steps) if new.test else new.epochs * steps
    with pytest.raises(UsageError) as refusal:
        state.check_resume(new, SimpleNamespace(is_main=True, world_size=1), 'ckpt', ckpt,
                           SimpleNamespace(classes=['a', 'b'], n_train=96), nn.Linear(2, 2),
                           resumed(new, 1, steps).optimizer, batch, steps, total)
    assert str(refusal.value) == says


# ------------------------------------------------------------------------------------ real runs
# 100 training images: an epoch is 7 steps of 16 images at 2 ranks x 8 (50 each), 13 of 8 at one
# rank (the last of 4), 5 of 24 at 3 ranks (34 each, the last of 2)
DATA = ['--synthetic-train-per-class', '25', '--log-interval', '1', '--chkpt']
VIT = ['--arch', 'timm:vit_tiny_patch16_224', '--optimizer', 'adamw', '--wd', '0',
       '--pipeline-stages', '2', '--microbatches', '2', '--pipeline-schedule', 'gpipe']


def launch(ranks, out, cache_dir, *flags_):
    common = [*TINY, *DATA, '--cache-dir', cache_dir, '--output-dir', out, *flags_]
    p = torchrun(ranks, *common) if ranks > 1 or '--shard' in flags_ else \
        run_cli(*common, env={'OMP_NUM_THREADS': '1'})
    assert p.returncode == 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    return p


def extends(tmp_path, cache_dir, before, after, steps, *flags_, first=()):
    """One epoch at before = (ranks, -b, global batch) (with `first` too), then -e 2 at `after`,
    whose epoch is `steps` steps: the second completes, its steps end at 2 of its epochs, and its
    last LR is the end of its schedule."""
    out = tmp_path / 'run'
    launch(before[0], out, cache_dir, '-e', '1', '-b', before[1], *flags_, *first)
    p = launch(after[0], out, cache_dir, '-e', '2', '-b', after[1], '--resume', 'auto',
               '--allow-batch-change', *flags_)
    summary = json.load(open(out / 'summary.json'))
    assert (summary['status'], summary['global_step']) == ('completed', 2 * steps), summary
    assert f'Resuming with global batch {after[2]} instead of {before[2]}: at step {steps} of ' \
           f'{2 * steps} (1 epoch(s) and 0 of the next {steps} steps done)' in p.stdout, p.stdout
    with open(out / 'metrics.jsonl') as f:
        train = [r for r in map(json.loads, f) if r['type'] == 'train']
    assert train[-1]['global_step'] == 2 * steps
    args = Namespace(**json.load(open(out / 'config.json')))
    assert train[-1]['lr'] == pytest.approx(last_lr(args, steps), rel=1e-9, abs=1e-15)
    return p


@FSDP
def test_a_run_extended_at_one_rank_from_two_sliced_ones_completes(tmp_path, cache_dir):
    """Issue 57's: written by 2 ranks under --shard full, continued by one process (DDP's mode,
    the .dcp folder read whole)."""
    extends(tmp_path, cache_dir, (2, 8, 16), (1, 8, 8), 13, first=['--shard', 'full'])


@pytest.mark.slow  # 9 x 2 launches of up to 3 ranks: 2 min on 2 cores
@pytest.mark.parametrize('scheduler', ['onecycle', 'cosine', 'poly'])
@pytest.mark.parametrize('before, after, steps, more', [
    ((2, 8, 16), (1, 8, 8), 13, []), ((1, 8, 8), (3, 8, 24), 5, []),
    pytest.param((2, 8, 16), (1, 8, 8), 13, ['--shard', 'full'], marks=FSDP)],
    ids=['2-to-1', '1-to-3', '2-to-1-full'])
def test_runs_extended_at_another_world_size_complete(tmp_path, cache_dir, scheduler, before,
                                                       after, steps, more):
    extends(tmp_path, cache_dir, before, after, steps, '--scheduler', scheduler,
            '--warmup-epochs', '0.5', *more)


@pytest.mark.slow  # 4 then 2 ranks of a ViT: 20 s
def test_a_pipeline_extended_with_half_its_replicas_completes(tmp_path, cache_dir):
    """2 stages x 2 replicas of -b 8 (6 steps of 16 images: 96 of 100, --drop-last), then 2 stages
    x 1 replica of -b 14 (7 steps of 14: 98): the checkpoint's cut and each stage's optimizer state
    are kept, and the finished epoch is the new loader's 7 steps (counted in images, 96 make 6
    steps of 14: the run would end at step 13, short of its schedule's end). --drop-last: a
    pipeline's short last batch (4 images) fails its schedule, which is cut for -b /
    --microbatches."""
    p = extends(tmp_path, cache_dir, (4, 8, 16), (2, 14, 14), 7, *VIT, '--drop-last')
    assert 'cut as the checkpoint was' in p.stdout, p.stdout
