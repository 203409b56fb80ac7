"""A run's state and its checkpoints: where the loop is (Progress), what a checkpoint holds, which
one --resume picks, whether this run can continue it, and putting it back. The files themselves
(atomic writes, listing, pruning) are record.checkpoint's."""
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from dlojzlib import readers
from dlojzlib.dist import launch, shard
from dlojzlib.errors import Complete, Interrupted, Preempted, UsageError
from dlojzlib.readers import ALL, Any, Bool, Dict, Int, List, Map, Maybe, Num, Shape, Str
from dlojzlib.record.checkpoint import (SHARDED, checkpoint_path, list_checkpoints,
                                        load_checkpoint, load_latest_checkpoint, save_checkpoint,
                                        save_sharded_checkpoint, space_warning, strip_prefixes)
from dlojzlib.record.log import SUMMARY_VERSION
from dlojzlib.record.resume import (as_written, checkpoint_steps, flag, position,
                                    schedule_changes)
from dlojzlib.record.rundir import complete_sentence, completed_run


@dataclass
class Progress:
    """Where the loop is, and its latest results."""
    epoch: int = 0
    step: int = 0          # steps done in this epoch
    global_step: int = 0
    images: int = 0        # training images seen, all ranks (an epoch's last batch may be smaller)
    train: dict = None     # the last epoch's training metrics
    val: dict = None       # the last validation
    val_ema: dict = None   # the last validation of the EMA weights
    best_top1: float = None
    # 'raw'/'ema' -> when validation first reached --target-top1
    reached: dict = field(default_factory=dict)
    # the epoch (or --test-nsteps) is trained; its validation and checkpoint are to come
    end_due: bool = False

    def advance(self, images=0):
        self.step += 1
        self.global_step += 1
        self.images += images


def device_rng_state(device):
    """This process's own GPU generator state (None on CPU). Not get_rng_state_all(): that is every
    visible GPU's, most of which this rank never draws from."""
    return torch.cuda.get_rng_state(device) if device.type == 'cuda' else None


def set_device_rng_state(state, device):
    if device.type == 'cuda':  # a GPU checkpoint resumed on CPU has no generator to restore
        torch.cuda.set_rng_state(state, device)


def checkpoint_state(run, progress, device_rng, model, optimizer):
    """device_rng: every rank's device_rng_state(), indexed by rank. model, optimizer: their state
    dicts whole (dist.shard.optimizer_state: ZeRO-1's consolidated on rank 0), or None in a
    sharded checkpoint, whose folder holds them in slices (save).
    The position is the loop's own: an epoch that is trained but not yet closed (end_due: a stop
    during its last step) is resumed by its validation. metrics_bytes: how much of metrics.jsonl was
    written then (the resumed run keeps that much)."""
    epoch, step = progress.epoch, progress.step
    return {'version': SUMMARY_VERSION, 'arch': run.args.arch, 'num_classes': len(run.data.classes),
            'classes': list(run.data.classes), 'train_images': run.data.n_train,
            'model': None if model is None else strip_prefixes(model), 'optimizer': optimizer,
            'scheduler': run.scheduler.state_dict(), 'scaler': run.scaler.state_dict(),
            'epoch': epoch,
            'step_in_epoch': step, 'end_due': progress.end_due, 'metrics_bytes': run.log.size(),
            'global_step': progress.global_step, 'global_batch': run.global_batch,
            'steps_per_epoch': run.steps_per_epoch,  # the loader's, for a resume that has others
            'pipeline': run.pipe.cut if run.pipe is not None else None,  # where a resume cuts
            'args': vars(run.args), 'ema': run.ema.state_dict() if run.ema is not None else None,
            'race': {'best_top1': progress.best_top1, 'reached': progress.reached,
                     'images': progress.images,
                     'wall_s': run_wall_s(run), 'process_wall_s': process_wall_s(run),
                     'val': progress.val,
                     'val_ema': progress.val_ema, 'train': progress.train},
            'rng': {'torch': torch.get_rng_state(), 'numpy': np.random.get_state(),
                    'python': random.getstate(),
                    'device': device_rng}}


def save(run, progress, best=False):
    """Every rank calls it: each rank's device RNG state is gathered, then rank 0 writes
    checkpoint-<global step>.pt in the run directory, keeping the newest --keep-checkpoints (or
    best.pt, pruning nothing). Where FSDP2 slices the model, every rank writes its slices into
    checkpoint-<global step>.dcp (or best.dcp) instead. A failure on any rank (a full disk) is
    raised on every rank. -> the path, on every rank."""
    device_rng = launch.all_gather_object(device_rng_state(run.device))
    piped = getattr(run.model_without_ddp, 'piped', False)  # a pipeline: each rank its part
    sharded = shard.is_sharded(run.model_without_ddp) or piped
    keep = None if best else run.args.keep_checkpoints
    path = os.path.join(run.args.output_dir, f'best{SHARDED if sharded else ".pt"}') if best \
        else checkpoint_path(run.args.output_dir, progress.global_step, sharded)
    warn = lambda: _space_warning(run.args.output_dir)
    if sharded:
        slices = run.pipe.state(run.optimizer) if piped else \
            shard.sharded_state(run.model_without_ddp, run.optimizer)
        launch.on_ranks(warn, when=run.dist.is_main)
        # rank 0's alone, before DCP's first collective: a failure is every rank's (on_ranks)
        rest = launch.on_ranks(lambda: checkpoint_state(run, progress, device_rng, None, None),
                               when=run.dist.is_main)
        save_sharded_checkpoint(path, slices, rest, keep, run.dist.is_main)
        run.log.print(f'Checkpoint {path} written (step {progress.global_step})')
        return path
    model = run.model_without_ddp.state_dict()
    optimizer = shard.optimizer_state(run.optimizer)  # every rank: ZeRO-1's parts, on rank 0

    def write():
        warn()
        state = checkpoint_state(run, progress, device_rng, model, optimizer)
        save_checkpoint(path, state, keep=keep)
    launch.on_ranks(write, when=run.dist.is_main)
    run.log.print(f'Checkpoint {path} written (step {progress.global_step})')
    return path


def _space_warning(folder):
    warning = space_warning(folder)
    if warning:
        print(f'dlojz: warning: {warning}', file=sys.stderr, flush=True)


def find_resume_checkpoint(args, dist, say):
    """-> (path, state) to resume from, or (None, None). Rank 0 picks the file under --resume auto
    so that every rank loads the same one (a rank seeing a half-written file must not choose
    another)."""
    if not args.resume:
        return None, None
    if args.resume != 'auto':
        path = os.path.normpath(args.resume)  # a .dcp folder given as 'checkpoint-<step>.dcp/'
        return path, load_checkpoint(path)
    warn = lambda m: print(m, file=sys.stderr, flush=True)
    found = launch.on_ranks(lambda: load_latest_checkpoint(args.output_dir, warn),
                            when=dist.is_main)
    path = launch.broadcast_object(found[0] if found else None)
    if path is None:
        say(f'--resume auto: no checkpoint in {args.output_dir}; starting from the beginning')
        return None, None
    say(f'--resume auto: continuing from {path}')
    return path, found[1] if dist.is_main else load_checkpoint(path)  # rank 0 has already read it


# The optimizer's hyperparameters a changed flag sets again after its state is loaded (the state
# carries the checkpoint's; --mom is the schedule's under onecycle: record.resume.schedule_changes),
# the keys of a schedule built for this run's flags (OneCycleLR keeps its bounds in the groups and
# sets the momentum at each step), and the choice of kernels, which is this device's (fused on a
# GPU) whatever the checkpoint's was.
HYPERPARAMETERS = {'wd': ('weight_decay',), 'mom': ('momentum', 'betas')}
SCHEDULE_KEYS = ('initial_lr', 'max_lr', 'min_lr', 'max_momentum', 'base_momentum', 'momentum',
                 'betas')
IMPLEMENTATION = ('fused', 'foreach', 'capturable', 'differentiable')

# What restore() reads from a checkpoint (checkpoint_state writes them all); 'ema' and 'race' may be
# absent.
RESUME_KEYS = ('model', 'epoch', 'step_in_epoch', 'global_step', 'global_batch')
TRAIN_KEYS = ('optimizer', 'scheduler', 'scaler', 'rng')


class Split(Shape):
    """--pipeline-split as a checkpoint keeps it: 'time', 'params' or stages.parse_split's tuple."""
    expected = 'time, params or increasing block numbers above 0'

    def accepts(self, value):
        if isinstance(value, str):
            return value in ('time', 'params')
        return isinstance(value, tuple) and len(value) > 0 and \
            all(type(b) is int and b > 0 for b in value) and list(value) == sorted(set(value))


_DICT = Map(Any)  # a state dict: names -> tensors or values
# A checkpoint's entries (checkpoint_state writes them) as the checks, the resume contract and
# restore read them, each checked before any is used; the tensors inside are torch's to check.
# Whether each is there is check_form's question (RESUME_KEYS, TRAIN_KEYS; some came later).
RACE = Dict({'best_top1': Maybe(Num()), 'reached': Maybe(Map(_DICT)), 'images': Int(0),
             'wall_s': Maybe(Num()), 'process_wall_s': Maybe(Num()), 'val': Maybe(_DICT),
             'val_ema': Maybe(_DICT), 'train': Maybe(_DICT)},
            optional=ALL)
CHECKPOINT = Dict({
    'arch': Str(max_len=200), 'num_classes': Int(1), 'classes': Maybe(List(Str())),
    'train_images': Maybe(Int(0)), 'model': _DICT,
    # torch's form, or a pipeline's: one such per stage
    'optimizer': Maybe(Dict({'param_groups': List(Dict({'params': List()}))},
                            optional=['param_groups'])),
    'scheduler': _DICT, 'scaler': _DICT, 'ema': Maybe(_DICT),
    'epoch': Int(0), 'step_in_epoch': Int(0), 'end_due': Bool(), 'global_step': Int(0),
    'global_batch': Int(1), 'steps_per_epoch': Int(1), 'metrics_bytes': Maybe(Int(0)),
    'race': Maybe(RACE),
    # the flags the resume contract puts back (record.resume's 'checkpoint' rows) become this run's
    'args': Dict({'seed': Int(0, 2 ** 32 - 1), 'pipeline_split': Split()},
                 optional=['seed', 'pipeline_split']),
    'rng': Dict({'torch': Any, 'numpy': Any, 'python': Any, 'device': Maybe(List())},
                optional=['device']),
}, optional=ALL)


def check_form(args, ckpt, path):
    """Refuse a file that is not a checkpoint dlojz can resume (or, with --evaluate, validate): one
    that lacks an entry, or holds one of another shape (CHECKPOINT)."""
    if not isinstance(ckpt, dict):
        raise UsageError(f'{path} is not a dlojz checkpoint (it holds a {type(ckpt).__name__}, not '
                         f'a dict); pass a checkpoint-*.pt written by --chkpt.')
    missing = [k for k in RESUME_KEYS + (() if args.evaluate else TRAIN_KEYS) if k not in ckpt]
    if missing:
        raise UsageError(f"checkpoint {path} lacks {', '.join(repr(k) for k in missing)}, which "
                         f"resuming needs; it was not written by this version of dlojz --chkpt (or "
                         f"was edited); pass another checkpoint.")
    try:
        CHECKPOINT.check(ckpt, '')
    except readers.Wrong as e:
        raise UsageError(f'checkpoint {path} {e}; it was not written by dlojz --chkpt (or was '
                         f'edited); pass another checkpoint.') from None
    except RecursionError:
        raise UsageError(f'checkpoint {path} nests deeper than any dlojz writes; pass another '
                         f'checkpoint.') from None


def check_checkpoint(args, ckpt, path, classes, n_train, global_batch, world_size):
    """Refuse a checkpoint this run cannot continue, before anything is written: another model,
    other classes, another training set (its steps are the position and the schedule), another
    global batch."""
    if ckpt.get('arch') != args.arch or ckpt.get('num_classes') != len(classes):
        raise UsageError(f"checkpoint {path} holds {ckpt.get('arch')} with "
                         f"{ckpt.get('num_classes')} classes but this run is --arch {args.arch} "
                         f"with {len(classes)} classes; pass the same --arch and data, or another "
                         f"checkpoint.")
    saved = ckpt.get('classes')  # None: written before checkpoints recorded them
    if saved is not None and list(saved) != list(classes):
        i = next(i for i, (a, b) in enumerate(zip(saved, classes)) if a != b)
        raise UsageError(f'checkpoint {path} was trained on other classes than this data\'s (class '
                         f'{i} is {saved[i]!r} there, {classes[i]!r} here): its outputs would be '
                         f'other labels; pass the data it was trained on, or start a new run.')
    if args.evaluate:
        return
    if ckpt.get('train_images') not in (None, n_train):
        raise UsageError(f"checkpoint {path} was trained on {ckpt['train_images']} training images "
                         f"and this data has {n_train}: its position in the epoch and its LR "
                         f"schedule count steps of the other set; pass the data it was trained on, "
                         f"or start a new run.")
    old = ckpt['global_batch']
    if old != global_batch and not args.allow_batch_change:
        hint = f'-b {old // (world_size * args.accum_steps)} to keep it, ' \
            if old % (world_size * args.accum_steps) == 0 else ''
        raise UsageError(f'checkpoint {path} was trained with a global batch of {old} images but '
                         f'this run has {global_batch} (-b {args.batch_size} x {world_size} '
                         f'processes x --accum-steps {args.accum_steps}); use {hint}or pass '
                         f'--allow-batch-change to continue with the new one.')


def check_resume(args, dist, path, ckpt, data, model, optimizer, global_batch, steps_per_epoch,
                 total_steps):
    """Everything a resume is refused for, before any log is opened: the checkpoint against the
    data, the model, the optimizer and the global batch, and the run's end against the checkpoint's
    position. A completed run that this command would not train further ends here (Complete: one
    line, exit 0, nothing written)."""
    if ckpt is not None:
        check_checkpoint(args, ckpt, path, data.classes, data.n_train, global_batch,
                         dist.world_size)
        check_fits(ckpt, path, args.arch, model, None if args.evaluate else optimizer)
    if args.evaluate or not args.resume:
        return
    # rank 0 reads it; a summary.json it refuses (a FIFO) stops every rank
    done = launch.broadcast_object(launch.on_ranks(lambda: completed_run(args.output_dir),
                                                   when=dist.is_main))
    # the checkpoint's position in this run's steps, as restore() puts it
    at = position(ckpt, global_batch, steps_per_epoch) if ckpt is not None else None
    step = at.global_step if at is not None else (done or {}).get('global_step')
    if step is None:  # nothing to continue: a fresh start
        return
    started = step + 1 if at is not None and at.partial else step  # the last step it trained in
    if started > total_steps:
        want = f'--test-nsteps {started}' if args.test and args.test_nsteps < started else \
            f'-e {-(-started // steps_per_epoch)}'
        where = f'checkpoint {path}' if ckpt is not None else \
            f'the completed run in {args.output_dir}'
        part = f' and partway through step {step + 1} of {global_batch} images' \
            if started > step else ''
        raise UsageError(f'{where} is at step {step}{part} but this run ends at step '
                         f'{total_steps}: a resumed run cannot end before its checkpoint; pass '
                         f'{want} or more to continue it'
                         + (f', or --evaluate --resume {path} to validate it.' if ckpt is not None
                            else '.'))
    if done is not None and step == total_steps:
        raise Complete(complete_sentence(args.output_dir, done))
    if done is not None and ckpt is None:
        raise UsageError(f'the run in {args.output_dir} completed without writing a checkpoint '
                         f'(--chkpt), so it cannot be trained further; start a new run (another '
                         f'--output-dir) with the length you want.')


def check_fits(ckpt, path, arch, model, optimizer=None):
    """Refuse a checkpoint whose weights or optimizer state this run's model and optimizer cannot
    take (an edited 'arch', other model flags, another optimizer's groups), before any log is
    opened."""
    mine, theirs = model.state_dict(), shard.part_of(model, strip_prefixes(ckpt['model']))
    if set(mine) != set(theirs) or any(_shape(mine[k]) != _shape(theirs[k]) for k in mine):
        raise UsageError(f"checkpoint {path} (labelled --arch {ckpt.get('arch')}) holds weights "
                         f"that do not fit this run's --arch {arch} model: "
                         f"{_first_difference(mine, theirs)}; pass the flags it was written with, "
                         f"or another checkpoint.")
    if optimizer is None:
        return
    groups, saved = optimizer.param_groups, (ckpt.get('optimizer') or {}).get('param_groups')
    sizes = lambda gs: [len(g['params']) for g in gs]
    if saved is not None and sizes(groups) != sizes(saved):
        raise UsageError(f"checkpoint {path}'s optimizer has {len(saved)} parameter groups of "
                         f"{sizes(saved)} tensors but this run's has "
                         f"{len(groups)} of {sizes(groups)}; pass the "
                         f"optimizer flags it was written with (--optimizer "
                         f"{(ckpt.get('args') or {}).get('optimizer', '?')}, its weight-decay "
                         f"options), or another checkpoint.")


def restore(run, ckpt, path='the checkpoint'):
    """Load a checkpoint (already checked) into the run; -> the Progress to continue from. What
    torch refuses (another model's weights, another number of parameter groups) becomes one sentence
    naming the file."""
    try:
        return _restore(run, ckpt)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # load_state_dict: the keys and shapes
        if isinstance(e, RuntimeError) and 'state_dict' in what:
            what = (f"its weights do not fit --arch {run.args.arch} ({what.rstrip(':. ')}; e.g. "
                    f"{_first_difference(run.model_without_ddp.state_dict(), ckpt['model'])})")
        elif isinstance(e, KeyError):
            what = f'it lacks the entry {e}'
        raise UsageError(f"checkpoint {path} (written by --arch {ckpt.get('arch')}, optimizer "
                         f"{(ckpt.get('args') or {}).get('optimizer', '?')}) cannot be loaded into "
                         f"this run: {what[:200]}; pass the flags it was written with (its "
                         f"'args'), or another checkpoint.") from None


def _shape(v):
    """A tensor's shape; None for a module's extra state (the conditional heads' RNG), which has
    none."""
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _first_difference(mine, theirs):
    theirs = strip_prefixes(theirs)
    for k in mine:
        if k not in theirs:
            return f'{k} is missing from it'
        if _shape(mine[k]) != _shape(theirs[k]):
            return f'{k} is {_shape(theirs[k])} there, {_shape(mine[k])} here'
    extra = [k for k in theirs if k not in mine]
    return f'{extra[0]} is not in this model' if extra else 'no key differs'


def load_optimizer(optimizer, state):
    """Load an optimizer's state with this device's kernels (fused on a GPU, whatever the
    checkpoint's were) -> take(keys), which sets those keys of every group back to this run's flags.

    The step counts go where this run's kernels read them. torch's load_state_dict moves them to the
    parameters' device only when the *saved* group was fused or capturable; a fused kernel reads
    them on the device (a CPU step there fails the step: a device mismatch, or an illegal memory
    access where the learning rate is a tensor), the others on the host (a device step there is read
    with .item(), a synchronisation per parameter and step).

    The moments take their parameter's memory layout: torch's load_state_dict keeps the saved
    strides, and a fused kernel refuses a channels-last parameter with contiguous moments ("must
    have same dtype, device, and layout"; a checkpoint from a --no-channels-last or CPU run,
    measured on an H100 with torch 2.11), where the foreach kernels fall back to a slow path."""
    # this run's flags
    fresh = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
    optimizer.load_state_dict(shard.optimizer_state_for(optimizer, state))

    def take(keys):
        for group, mine in zip(optimizer.param_groups, fresh):
            group.update({k: mine[k] for k in keys if k in mine})
    take(IMPLEMENTATION)
    local = shard.local_optimizer(optimizer)  # ZeRO-1: this rank's part (following the groups)
    for group in local.param_groups:
        on_device = group.get('fused') or group.get('capturable')
        for p in group['params']:
            state = local.state.get(p, {})
            step = state.get('step')
            where = p.device if on_device else torch.device('cpu')
            if isinstance(step, torch.Tensor) and step.device != where:
                dtype = torch.float32 if on_device else step.dtype  # fused kernels take float32
                state['step'] = step.to(device=where, dtype=dtype)
            for key, value in list(state.items()):
                if _restride(value, p):
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)
    return take


def _restride(value, p):
    """Whether an optimizer state tensor is one of p's moments (p's shape) laid out otherwise."""
    return (isinstance(value, torch.Tensor) and value.shape == p.shape and value.device == p.device
            and value.stride() != p.stride())


def _restore(run, ckpt):
    shard.load_model_state(run.model_without_ddp, ckpt['model'])
    race = ckpt.get('race') or {}
    # --evaluate validates the checkpoint as written, at its own step
    at = as_written(ckpt) if run.args.evaluate else \
        position(ckpt, run.global_batch, run.steps_per_epoch)
    progress = Progress(epoch=at.epoch, step=at.step, global_step=at.global_step,
                        best_top1=race.get('best_top1'), reached=race.get('reached') or {},
                        images=race.get('images', ckpt['global_step'] * ckpt['global_batch']),
                        val=race.get('val'), val_ema=race.get('val_ema'), train=race.get('train'),
                        end_due=at.end_due)
    if progress.end_due and not run.args.evaluate:
        run.log.print(f'The checkpoint was written as epoch {progress.epoch + 1} (or '
                      f'--test-nsteps) ended, before its validation and closing checkpoint: they '
                      f'come first')
    run.started -= race.get('wall_s') or 0.0  # time to accuracy counts the earlier attempts too
    run.process_started -= race.get('process_wall_s') or race.get('wall_s') or 0.0
    if run.ema is not None:  # a checkpoint without an EMA starts one from its weights
        run.ema.load_state_dict(ckpt['ema'] if ckpt.get('ema') else
                                {'module': run.model_without_ddp.state_dict(), 'updates': 0})
    if run.args.evaluate:
        return progress
    saved = ckpt['optimizer'] if run.pipe is None else run.pipe.optimizer_part(ckpt['optimizer'])
    take = load_optimizer(run.optimizer, saved)
    was = ckpt.get('args') or {}
    # the resume contract: a changed flag is used from here on
    for dest, keys in HYPERPARAMETERS.items():
        if dest in was and was[dest] != getattr(run.args, dest):
            take(keys)
    # empty when the checkpoint's run did not use fp16: then this run's scaler starts afresh
    if ckpt['scaler']:
        run.scaler.load_state_dict(ckpt['scaler'])
    torch.set_rng_state(ckpt['rng']['torch'])
    np.random.set_state(ckpt['rng']['numpy'])
    random.setstate(ckpt['rng']['python'])
    device_rng = ckpt['rng'].get('device') or []
    rank = run.dist.rank  # at another world size, ranks beyond the old ones keep their own seed's
    if rank < len(device_rng) and device_rng[rank] is not None:
        set_device_rng_state(device_rng[rank], run.device)
    rebuilt = schedule_changes(run.args, was)
    if not at.moved and not rebuilt:
        run.scheduler.load_state_dict(ckpt['scheduler'])
        return progress
    steps, end = run.steps_per_epoch, run.args.epochs * run.steps_per_epoch
    if at.moved:  # the position in this run's steps (resume.position), where its schedule continues
        old, gb = ckpt['global_batch'], run.global_batch
        its = checkpoint_steps(ckpt)
        change = f'global batch {gb} instead of {old}' if gb != old else \
            f'{steps} steps an epoch instead of {its}' if its else \
            f'{steps} steps an epoch (the checkpoint, by an older dlojz, does not say its own)'
        run.log.print(f'Resuming with {change}: at step {at.global_step} of {end} ({at.epoch} '
                      f'epoch(s) and {at.step} of the next {steps} steps done)')
    before = run.optimizer.param_groups[0]['lr']  # the checkpoint's schedule's, for its next step
    take(SCHEDULE_KEYS)  # the new schedule's peak, bounds, momenta (not one-cycle's cycled one)
    # the schedules are closed forms of the step: one step() puts this run's at the position, and
    # the steps left (end - position) take it to its end
    run.scheduler.last_epoch = progress.global_step - 1
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter('ignore')
        run.scheduler.step()
    if rebuilt:
        changes = ', '.join(f'{flag(d)} {getattr(run.args, d)} (was {was[d]})' for d in rebuilt)
        run.log.print(f'The LR schedule is rebuilt for {changes}: it continues at step '
                      f'{progress.global_step} with LR {run.optimizer.param_groups[0]["lr"]:.4g} '
                      f'where the checkpoint\'s schedule gave {before:.4g}, then follows '
                      f'{run.args.scheduler} to its end at step {end}.')
    return progress


def preempt(run, progress):
    """Every rank got here at the same step (StopSignal.agreed). Rank 0 checkpoints while the others
    wait, then the SLURM job is requeued: its next start resumes with --resume auto. Ends in
    Preempted."""
    args, dist = run.args, run.dist
    run.chrono.stop()
    why = run.stop.received or 'a signal on another rank'
    # before the first step (a stop during start-up or the first loader start) there is nothing to
    # keep
    path = save(run, progress) if progress.global_step else None
    requeued, detail = False, '--no-requeue'
    if args.requeue:
        requeued, detail = launch.on_ranks(lambda: launch.requeue(dist, run.stop.received),
                                               when=dist.is_main) or (False, '')
    requeued = launch.broadcast_object(requeued)
    kept = f'checkpoint {path} written' if path else 'no checkpoint (no step had run)'
    raise Preempted(f'stopped by {why} at step {progress.global_step}; {kept}. ' +
                    ('The SLURM job was requeued and will resume from it (--resume '
                     'auto).' if requeued else
                     f'Not requeued ({detail}); ' + (
                         f'resubmit with the same flags to continue it (run name {args.run_name}).'
                         if args.run_name and args.resume == 'auto' else
                         f'continue with --resume auto --run-name {args.run_name}.' if args.run_name
                         else f'continue with --resume auto --output-dir {args.output_dir}.')),
                    requeued=requeued, checkpoint=path)


def run_wall_s(run):
    """Wall time since the run was first built, earlier attempts of a resumed run included
    (restore): time to accuracy as MLPerf's rules count it (from the run's start, after imports and
    set-up)."""
    return time.time() - run.started


def process_wall_s(run):
    """Wall time since the process started (imports, process group, data and model set-up included),
    earlier attempts of a resumed run included: what a user's stopwatch and the job's accounting
    see."""
    return time.time() - run.process_started


def note_validation(run, progress):
    """After a validation: best.pt when raw top-1 improves (with --chkpt; not in --test mode, whose
    validation is 20 batches), and the first time the raw and the EMA weights reached --target-top1
    (wall time, epoch, optimizer steps, images seen)."""
    target = run.args.target_top1
    for kind, val in (('raw', progress.val), ('ema', progress.val_ema)):
        if target is not None and val is not None and kind not in progress.reached and \
                val['top1'] >= target:
            progress.reached[kind] = {'top1': val['top1'], 'wall_s': val['wall_s'],
                                      'process_wall_s': val.get('process_wall_s'),
                                      'epoch': val['epoch'],
                                      'global_step': val['global_step'],
                                      'train_images': val['train_images']}
            run.log.print(f">>> Reached top-1 {target:g} ({kind} weights) after "
                          f"{val['wall_s']:.1f} s, epoch {val['epoch']}, {val['train_images']} "
                          f"images")
    top1 = progress.val['top1']
    improved = progress.best_top1 is None or top1 > progress.best_top1
    progress.best_top1 = max(top1, progress.best_top1 or 0.0)
    if run.args.chkpt and not run.args.test and improved:
        save(run, progress, best=True)


def interrupted(args, step):
    """Ctrl-C: the step under way is lost (the interrupt can land anywhere in it, so nothing is
    saved now); -> Interrupted saying, like a preemption, which checkpoint the run can continue
    from and how."""
    kept = args.output_dir and os.path.isdir(args.output_dir)
    found = list_checkpoints(args.output_dir) if kept else []
    folder = f'--run-name {args.run_name}' if args.run_name else f'--output-dir {args.output_dir}'
    if not found:
        return Interrupted(f'interrupted at step {step}; no checkpoint was written (--chkpt, '
                           f'--chkpt-every N write them), so this run cannot be continued: run it '
                           f'again.',
                           failed_step=step)
    return Interrupted(f'interrupted at step {step}; its newest checkpoint is {found[-1]}: '
                       f'continue with --resume auto {folder} (the steps after that checkpoint run '
                       f'again).',
                       failed_step=step,
                       checkpoint=found[-1])
