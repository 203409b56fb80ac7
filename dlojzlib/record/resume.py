"""The resume contract: what a resumed run does with each flag whose value differs from its
checkpoint's, one row per flag of --help (docs/resume.md is this table in words; a test keeps the
two equal and fails on a flag without a row). Torch-free: it compares two sets of flags.

    honoured    the new value is used from the resume on, and recorded
    extends     the run's length: above the checkpoint's position it continues, below it is refused
    refused     one sentence, nothing written: the checkpoint's state cannot continue under the new
                value
    checked     honoured while the checkpoint still fits (the same classes, training set, weights
                and optimizer groups), refused with one sentence where it does not
    checkpoint  the checkpoint's value is kept (and recorded), with one warning line
    mode        another mode, which trains nothing from the checkpoint: in a folder that holds a
                training run it is refused with one sentence

Values are compared as check_args resolved them (a default that follows the node, such as
--num-workers, is compared as resolved). resolve() makes the refusals that need nothing but the
flags; the 'checked' rows, --arch and the global batch are record.state's (check_checkpoint knows
the data and the world size, check_fits the model and the optimizer), the modes' their own.
position() puts the checkpoint's position in the resumed run's steps.
"""
from typing import NamedTuple

from dlojzlib.errors import UsageError

HONOURED, EXTENDS, REFUSED, CHECKED = 'honoured', 'extends', 'refused', 'checked'
CHECKPOINT, MODE = 'checkpoint', 'mode'

# dest -> (rule, what it means on resume); the docs page shows these words
CONTRACT = {
    # data: the data may move (another --data-dir, cache, decode path); its classes and training set
    # may not
    'data_dir': (CHECKED, 'the same classes and number of training images'),
    'cache_dir': (CHECKED, 'the same classes and number of training images'),
    'stage_dir': (HONOURED, ''),
    'rescan_data': (HONOURED, ''),
    'synthetic_classes': (CHECKED, 'other classes (with the synthetic data): the checkpoint\'s '
                                   'labels are others'),
    'synthetic_train_per_class': (CHECKED, 'another training set (with the synthetic data): the '
                                           'position counts its steps'),
    'synthetic_val_per_class': (HONOURED, ''),
    'synthetic_seed': (CHECKED, 'the same classes and number of training images'),
    'fake_data': (CHECKED, 'other data: other classes or another training set'),
    'fake_train_size': (CHECKED, 'another training set (with --fake-data): the position counts its '
                                 'steps'),
    'fake_val_size': (HONOURED, ''),
    'fake_classes': (CHECKED, 'other classes (with --fake-data)'),
    'image_size': (HONOURED, 'the model takes any resolution'),
    'val_resize': (HONOURED, ''),
    'val_image_size': (HONOURED, ''),
    'decode': (HONOURED, 'the same crops and flips, decoded another way'),
    'decode_ahead': (HONOURED, ''),
    'loader': (HONOURED, 'the same batches, crops and flips, decoded by DALI or by the native '
                         'workers'),
    'skip_bad_images': (HONOURED, ''),
    # loader
    'batch_size': (REFUSED, 'unless --allow-batch-change: the position is then put in the new '
                            'steps, counted in images, and the schedule rebuilt for them'),
    'val_batch_size': (HONOURED, ''),
    'num_workers': (HONOURED, ''),
    'persistent_workers': (HONOURED, ''),
    'pin_memory': (HONOURED, ''),
    'non_blocking': (HONOURED, ''),
    'prefetch_factor': (HONOURED, ''),
    'drop_last': (REFUSED, 'it changes the steps of an epoch, hence the position and the schedule'),
    'loader_only': (MODE, 'measures the loader of a new run (--resume is dropped)'),
    'tune_loader': (MODE, 'measures the loader of a new run (--resume is dropped)'),
    # model
    'arch': (REFUSED, 'the weights do not fit another model'),
    'sd_prob': (HONOURED, 'stochastic depth has no weights'),
    'n_heads': (CHECKED, 'the weights of a -heads arch do not fit another number of heads'),
    'grad_checkpointing': (HONOURED, ''),
    # precision and compilation
    'amp': (HONOURED, 'the fp16 loss scale is kept only between two fp16 runs; a new one starts '
                      'otherwise'),
    'channels_last': (HONOURED, ''),
    'tf32': (HONOURED, ''),
    'cudnn_benchmark': (HONOURED, ''),
    'deterministic': (HONOURED, ''),
    'compile': (HONOURED, ''),
    'compile_mode': (HONOURED, ''),
    # optimization
    'optimizer': (REFUSED, 'the optimizer state (momenta, moments) belongs to the checkpoint\'s '
                           'optimizer'),
    'lr': (HONOURED, 'the LR schedule is rebuilt for it and continues at the current step (one '
                     'line says the LR there)'),
    'base_lr': (HONOURED, 'through --lr, which it sets: the schedule is rebuilt as for --lr'),
    'wd': (HONOURED, 'set in the optimizer\'s groups after its state is loaded'),
    'wd_norm_bias': (CHECKED, 'the optimizer\'s parameter groups where it changes them'),
    'mom': (HONOURED, 'set in the optimizer\'s groups after its state is loaded (onecycle cycles '
                      'the momentum itself)'),
    'accum_steps': (REFUSED, 'unless --allow-batch-change: it changes the global batch'),
    'label_smoothing': (HONOURED, ''),
    'scheduler': (HONOURED, 'the schedule is rebuilt and continues at the current step (one line '
                            'says the LR there)'),
    'warmup_epochs': (HONOURED, 'the schedule is rebuilt and continues at the current step'),
    'poly_power': (HONOURED, 'the schedule is rebuilt and continues at the current step'),
    'ema_decay': (HONOURED, 'a new EMA starts from the current weights; without it the EMA is '
                            'dropped'),
    'ema_warmup': (HONOURED, ''),
    'findlr': (REFUSED, 'an LR sweep starts from a fresh model'),
    # augmentation
    'randaugment': (HONOURED, ''),
    'trivialaugment': (HONOURED, ''),
    'random_erasing': (HONOURED, ''),
    'mixup': (HONOURED, ''),
    'cutmix': (HONOURED, ''),
    'res_start': (HONOURED, 'the resolution follows the new schedule from the current epoch'),
    'res_end_epoch': (HONOURED, 'the resolution follows the new schedule from the current epoch'),
    # run
    'epochs': (EXTENDS, 'more epochs continue the run (the LR schedule is rebuilt for the new '
                        'length); fewer than the checkpoint has done are refused'),
    'test': (EXTENDS, 'as --test-nsteps'),
    'test_nsteps': (EXTENDS, 'counts the whole run: more steps continue it; fewer than the '
                             'checkpoint\'s are refused'),
    'seed': (CHECKPOINT, 'the data order and the random streams continue from the checkpoint'),
    'device': (HONOURED, 'a GPU checkpoint continues on CPU and back; the GPU random stream is '
                         'kept per rank'),
    'output_dir': (HONOURED, 'names the folder resumed (a copied run continues where it is)'),
    'run_name': (HONOURED, 'names the folder resumed'),
    'overwrite': (REFUSED, 'with --resume: one starts the folder afresh, the other continues it'),
    'val_every': (HONOURED, ''),
    'target_top1': (HONOURED, 'a target already reached stays reached'),
    'chkpt': (HONOURED, ''),
    'chkpt_every': (HONOURED, ''),
    'keep_checkpoints': (HONOURED, ''),
    'resume': (HONOURED, 'which checkpoint: auto, or a path'),
    'requeue': (HONOURED, ''),
    'allow_batch_change': (HONOURED, 'allows another global batch'),
    'evaluate': (MODE, 'validates the checkpoint and trains nothing'),
    # distributed
    'sync_bn': (HONOURED, ''),
    'find_unused_parameters': (HONOURED, ''),
    'bucket_cap_mb': (HONOURED, ''),
    'static_graph': (HONOURED, ''),
    'gradient_as_bucket_view': (HONOURED, ''),
    'broadcast_buffers': (HONOURED, ''),
    'dist_timeout': (HONOURED, ''),
    'nccl_debug': (HONOURED, ''),
    'dist_debug': (HONOURED, ''),
    'shard': (HONOURED, 'a checkpoint (a `.pt` file, or under `gradients` and `full` a `.dcp` '
                        "folder of every rank's slices) loads under another mode and world size"),
    'cpu_offload': (HONOURED, ''),
    'share_gpu': (HONOURED, ''),
    # pipeline parallelism
    'pipeline_stages': (REFUSED, 'each stage keeps the optimizer state of its own blocks; '
                                 '--evaluate validates a checkpoint under any'),
    'microbatches': (HONOURED, 'the step follows the mean over its images, however split'),
    'pipeline_schedule': (CHECKED, "the checkpoint's cut: gpipe and 1f1b hold as many stages, "
                                   'interleaved twice as many'),
    'pipeline_split': (CHECKPOINT, "the checkpoint's cut is kept: each stage's blocks and their "
                                   'optimizer state'),
    # logging and profiling
    'log_interval': (HONOURED, ''),
    'metric_step': (HONOURED, ''),
    'metric_sync_log': (HONOURED, ''),
    'wandb': (HONOURED, ''),
    'prof': (HONOURED, ''),
    'prof_wait': (HONOURED, ''),
    'prof_warmup': (HONOURED, ''),
    'prof_active': (HONOURED, ''),
    # benchmark
    'timing': (HONOURED, ''),
    'sync_timing': (HONOURED, ''),
    'warmup_steps': (HONOURED, 'counted from the resumed attempt\'s first step'),
    # tuning
    'tune': (MODE, 'trials of their own, in a folder of their own'),
    'tune_budget': (HONOURED, 'read by --tune only'),
    'tune_steps': (HONOURED, 'read by --tune only'),
    'tune_memory_gib': (HONOURED, 'read by --tune only'),
    'tune_max_batch': (HONOURED, 'read by --tune only'),
    'tune_machine': (HONOURED, 'read by --tune only'),
}

# the flags whose change rebuilds the LR schedule at the current step (with the global batch,
# record.state's)
SCHEDULE = ('lr', 'scheduler', 'warmup_epochs', 'poly_power', 'epochs')
# differ on every resume, or already shown through the value they set
NOT_SHOWN = ('resume', 'base_lr')
# Refused elsewhere: --arch and the global batch (world size, --allow-batch-change) by
# check_checkpoint, which knows the data and the world size; --overwrite and --findlr beside
# --resume by check_flags, whatever the checkpoint's flags.
ELSEWHERE = ('batch_size', 'accum_steps', 'arch', 'overwrite', 'findlr')


class Position(NamedTuple):
    """Where a resumed run stands, in its own steps. moved: the checkpoint counted other steps
    (another global batch, or another number of steps an epoch), so its LR schedule is not this
    run's. partial: the checkpoint had trained some of the images of step global_step + 1 (they are
    trained again)."""
    epoch: int        # epochs trained to their end
    step: int         # optimizer steps done in the epoch under way
    global_step: int
    end_due: bool     # trained to the epoch's (or --test-nsteps') end; its validation is to come
    moved: bool = False
    partial: bool = False


def as_written(ckpt):
    """The checkpoint's own position."""
    return Position(ckpt['epoch'], ckpt['step_in_epoch'], ckpt['global_step'],
                    ckpt.get('end_due', False))


def position(ckpt, global_batch, steps_per_epoch):
    """The checkpoint's position in the steps of this run (`global_batch` images each,
    `steps_per_epoch` an epoch: as many as its loader yields, after its rounding) -> Position.

    With the checkpoint's global batch and steps an epoch, its own position. Otherwise the epochs
    trained stay trained, an epoch trained to its last step (owing its validation) included; the
    epoch under way restarts at the batch holding its first image not yet seen, or is trained where
    the images left do not fill one of this loader's steps. The global step is then the epochs'
    steps and the epoch's, so that a schedule of -e x steps_per_epoch ends at the run's last step.
    """
    old_batch, epoch, done = ckpt['global_batch'], ckpt['epoch'], ckpt['step_in_epoch']
    end_due, old_steps = ckpt.get('end_due', False), checkpoint_steps(ckpt)
    if old_batch == global_batch and old_steps == steps_per_epoch:
        return as_written(ckpt)
    # unknown (a checkpoint of an older dlojz, in its first epoch): one owing its validation
    # outside --test had trained the epoch to its end
    finished = done == old_steps if old_steps else \
        end_due and not (ckpt.get('args') or {}).get('test')
    seen = 0 if finished else done * old_batch  # images of the epoch under way
    step = steps_per_epoch if finished else min(seen // global_batch, steps_per_epoch)
    return Position(epoch, step, epoch * steps_per_epoch + step,
                    end_due=end_due or step == steps_per_epoch, moved=True,
                    partial=step < steps_per_epoch and seen > step * global_batch)


def checkpoint_steps(ckpt):
    """The steps an epoch of the checkpoint's run: recorded, or (by an older dlojz) read from its
    position, global step = epochs x steps an epoch + step; None in its first epoch, or where the
    position does not divide (edited)."""
    if ckpt.get('steps_per_epoch'):
        return ckpt['steps_per_epoch']
    epoch, step = ckpt['epoch'], ckpt['step_in_epoch']
    steps, rest = divmod(ckpt['global_step'] - step, epoch) if epoch else (0, 1)
    return steps if rest == 0 and steps >= max(step, 1) else None


def flag(dest):
    return '--' + dest.replace('_', '-')


def changed(args, old):
    """The flags whose value differs from the checkpoint's args (`old`, a dict): {dest: (old, new)}.
    Flags the checkpoint does not know (written by an older dlojz) are left out."""
    return {d: (old[d], getattr(args, d))
            for d in CONTRACT if d in old and old[d] != getattr(args, d)}


def schedule_changes(args, old):
    """The changed flags that rebuild the LR schedule at the current step: those of SCHEDULE, and
    --mom under onecycle, whose momentum is the cycle's (rebuilt, it is where the cycle says;
    copied, it would be --mom's)."""
    rebuilt = [d for d in SCHEDULE if d in old and old[d] != getattr(args, d)]
    cycled = args.scheduler == 'onecycle' and old.get('mom', args.mom) != args.mom
    return rebuilt + ['mom'] if cycled else rebuilt


def resolve(args, old, say):
    """Apply the contract to `args` before the run is built: refuse what cannot continue, put back
    what the checkpoint keeps (with a warning line), and say in one line what is used anew. -> args.
    """
    diff = changed(args, old)
    for dest, (was, now) in diff.items():
        rule, why = CONTRACT[dest]
        if rule == REFUSED and dest not in ELSEWHERE:
            raise UsageError(f'{flag(dest)} {now} differs from the checkpoint\'s {was} and a '
                             f'resumed run cannot change it ({why}); pass {flag(dest)} {was}, or '
                             f'start a new run in another folder.')
        if rule == CHECKPOINT:
            setattr(args, dest, was)
            say(f'Warning: {flag(dest)} {now} differs from the checkpoint\'s {was}: the run keeps '
                f'{was} ({why}); start a new run to change it.')
    used = [f'{flag(d)} {now} (was {was})' for d, (was, now) in diff.items()
            if CONTRACT[d][0] in (HONOURED, EXTENDS, CHECKED) and d not in NOT_SHOWN]
    if used:
        say('Resumed with changed flags, used from here on: ' + ', '.join(used))
    return args
