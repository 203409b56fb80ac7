"""The resume contract: what a resumed run does with each flag whose value differs from its checkpoint's, one
row per flag of --help (docs/resume.md is this table in words; a test keeps the two equal and fails on a flag
without a row). Torch-free: it compares two sets of flags.

    honoured    the new value is used from the resume on, and recorded
    extends     the run's length: above the checkpoint's position it continues, below it is refused
    refused     one sentence, nothing written: the checkpoint's state cannot continue under the new value
    checked     honoured while the checkpoint still fits (the same classes, training set, weights and
                optimizer groups), refused with one sentence where it does not
    checkpoint  the checkpoint's value is kept (and recorded), with one warning line
    mode        another mode, which trains nothing from the checkpoint: in a folder that holds a training
                run it is refused with one sentence

Values are compared as check_args resolved them (a default that follows the node, such as --num-workers,
is compared as resolved). resolve() makes the refusals that need nothing but the flags; the 'checked' rows,
--arch and the global batch are record.state's (check_checkpoint knows the data and the world size, check_fits
the model and the optimizer), the modes' their own.
"""
from dlojzlib.errors import UsageError

H, X, R, K, C, M = 'honoured', 'extends', 'refused', 'checked', 'checkpoint', 'mode'

# dest -> (rule, what it means on resume); the docs page shows these words
CONTRACT = {
    # data: the data may move (another --data-dir, cache, decode path); its classes and training set may not
    'data_dir': (K, 'the same classes and number of training images'),
    'cache_dir': (K, 'the same classes and number of training images'),
    'stage_dir': (H, ''),
    'synthetic_classes': (K, 'other classes (with the synthetic data): the checkpoint\'s labels are others'),
    'synthetic_train_per_class': (K, 'another training set (with the synthetic data): the position counts its steps'),
    'synthetic_val_per_class': (H, ''),
    'synthetic_seed': (K, 'the same classes and number of training images'),
    'fake_data': (K, 'other data: other classes or another training set'),
    'fake_train_size': (K, 'another training set (with --fake-data): the position counts its steps'),
    'fake_val_size': (H, ''),
    'fake_classes': (K, 'other classes (with --fake-data)'),
    'image_size': (H, 'the model takes any resolution'),
    'val_resize': (H, ''),
    'val_image_size': (H, ''),
    'decode': (H, 'the same crops and flips, decoded another way'),
    'decode_ahead': (H, ''),
    'loader': (H, 'the same batches, crops and flips, decoded by DALI or by the native workers'),
    'skip_bad_images': (H, ''),
    # loader
    'batch_size': (R, 'unless --allow-batch-change: the position and the schedule are then converted in images'),
    'val_batch_size': (H, ''),
    'num_workers': (H, ''),
    'persistent_workers': (H, ''),
    'pin_memory': (H, ''),
    'non_blocking': (H, ''),
    'prefetch_factor': (H, ''),
    'drop_last': (R, 'it changes the steps of an epoch, hence the position and the schedule'),
    'loader_only': (M, 'measures the loader of a new run (--resume is dropped)'),
    'tune_loader': (M, 'measures the loader of a new run (--resume is dropped)'),
    # model
    'arch': (R, 'the weights do not fit another model'),
    'sd_prob': (H, 'stochastic depth has no weights'),
    'n_heads': (K, 'the weights of a -heads arch do not fit another number of heads'),
    'grad_checkpointing': (H, ''),
    # precision and compilation
    'amp': (H, 'the fp16 loss scale is kept only between two fp16 runs; a new one starts otherwise'),
    'channels_last': (H, ''),
    'tf32': (H, ''),
    'cudnn_benchmark': (H, ''),
    'deterministic': (H, ''),
    'compile': (H, ''),
    'compile_mode': (H, ''),
    # optimization
    'optimizer': (R, 'the optimizer state (momenta, moments) belongs to the checkpoint\'s optimizer'),
    'lr': (H, 'the LR schedule is rebuilt for it and continues at the current step (one line says the LR there)'),
    'base_lr': (H, 'through --lr, which it sets: the schedule is rebuilt as for --lr'),
    'wd': (H, 'set in the optimizer\'s groups after its state is loaded'),
    'wd_norm_bias': (K, 'the optimizer\'s parameter groups where it changes them'),
    'mom': (H, 'set in the optimizer\'s groups after its state is loaded (onecycle cycles the momentum itself)'),
    'accum_steps': (R, 'unless --allow-batch-change: it changes the global batch'),
    'label_smoothing': (H, ''),
    'scheduler': (H, 'the schedule is rebuilt and continues at the current step (one line says the LR there)'),
    'warmup_epochs': (H, 'the schedule is rebuilt and continues at the current step'),
    'poly_power': (H, 'the schedule is rebuilt and continues at the current step'),
    'ema_decay': (H, 'a new EMA starts from the current weights; without it the EMA is dropped'),
    'ema_warmup': (H, ''),
    'findlr': (R, 'an LR sweep starts from a fresh model'),
    # augmentation
    'randaugment': (H, ''),
    'trivialaugment': (H, ''),
    'random_erasing': (H, ''),
    'mixup': (H, ''),
    'cutmix': (H, ''),
    'res_start': (H, 'the resolution follows the new schedule from the current epoch'),
    'res_end_epoch': (H, 'the resolution follows the new schedule from the current epoch'),
    # run
    'epochs': (X, 'more epochs continue the run (the LR schedule is rebuilt for the new length); fewer than the '
                  'checkpoint has done are refused'),
    'test': (X, 'as --test-nsteps'),
    'test_nsteps': (X, 'counts the whole run: more steps continue it; fewer than the checkpoint\'s are refused'),
    'seed': (C, 'the data order and the random streams continue from the checkpoint'),
    'device': (H, 'a GPU checkpoint continues on CPU and back; the GPU random stream is kept per rank'),
    'output_dir': (H, 'names the folder resumed (a copied run continues where it is)'),
    'run_name': (H, 'names the folder resumed'),
    'overwrite': (R, 'with --resume: one starts the folder afresh, the other continues it'),
    'val_every': (H, ''),
    'target_top1': (H, 'a target already reached stays reached'),
    'chkpt': (H, ''),
    'chkpt_every': (H, ''),
    'keep_checkpoints': (H, ''),
    'resume': (H, 'which checkpoint: auto, or a path'),
    'requeue': (H, ''),
    'allow_batch_change': (H, 'allows another global batch'),
    'evaluate': (M, 'validates the checkpoint and trains nothing'),
    # distributed
    'sync_bn': (H, ''),
    'find_unused_parameters': (H, ''),
    'bucket_cap_mb': (H, ''),
    'static_graph': (H, ''),
    'gradient_as_bucket_view': (H, ''),
    'broadcast_buffers': (H, ''),
    'dist_timeout': (H, ''),
    'nccl_debug': (H, ''),
    'dist_debug': (H, ''),
    'share_gpu': (H, ''),
    # logging and profiling
    'log_interval': (H, ''),
    'metric_step': (H, ''),
    'metric_sync_log': (H, ''),
    'wandb': (H, ''),
    'prof': (H, ''),
    'prof_wait': (H, ''),
    'prof_warmup': (H, ''),
    'prof_active': (H, ''),
    # benchmark
    'timing': (H, ''),
    'sync_timing': (H, ''),
    'warmup_steps': (H, 'counted from the resumed attempt\'s first step'),
    # tuning
    'tune': (M, 'trials of their own, in a folder of their own'),
    'tune_budget': (H, 'read by --tune only'),
    'tune_steps': (H, 'read by --tune only'),
    'tune_memory_gib': (H, 'read by --tune only'),
    'tune_max_batch': (H, 'read by --tune only'),
    'tune_machine': (H, 'read by --tune only'),
}

# the flags whose change rebuilds the LR schedule at the current step (with the global batch, record.state's)
SCHEDULE = ('lr', 'scheduler', 'warmup_epochs', 'poly_power', 'epochs')
NOT_SHOWN = ('resume', 'base_lr')  # differ on every resume, or already shown through the value they set
# Refused elsewhere: --arch and the global batch (world size, --allow-batch-change) by check_checkpoint, which
# knows the data and the world size; --overwrite and --findlr beside --resume by check_flags, whatever the
# checkpoint's flags.
ELSEWHERE = ('batch_size', 'accum_steps', 'arch', 'overwrite', 'findlr')


def flag(dest):
    return '--' + dest.replace('_', '-')


def changed(args, old):
    """The flags whose value differs from the checkpoint's args (`old`, a dict): {dest: (old, new)}. Flags the
    checkpoint does not know (written by an older dlojz) are left out."""
    return {d: (old[d], getattr(args, d)) for d in CONTRACT if d in old and old[d] != getattr(args, d)}


def schedule_changes(args, old):
    """The changed flags that rebuild the LR schedule at the current step: those of SCHEDULE, and --mom under
    onecycle, whose momentum is the cycle's (rebuilt, it is where the cycle says; copied, it would be --mom's)."""
    rebuilt = [d for d in SCHEDULE if d in old and old[d] != getattr(args, d)]
    return rebuilt + ['mom'] if args.scheduler == 'onecycle' and old.get('mom', args.mom) != args.mom else rebuilt


def resolve(args, old, say):
    """Apply the contract to `args` before the run is built: refuse what cannot continue, put back what the
    checkpoint keeps (with a warning line), and say in one line what is used anew. -> args."""
    diff = changed(args, old)
    for dest, (was, now) in diff.items():
        rule, why = CONTRACT[dest]
        if rule == R and dest not in ELSEWHERE:
            raise UsageError(f'{flag(dest)} {now} differs from the checkpoint\'s {was} and a resumed run cannot '
                             f'change it ({why}); pass {flag(dest)} {was}, or start a new run in another folder.')
        if rule == C:
            setattr(args, dest, was)
            say(f'Warning: {flag(dest)} {now} differs from the checkpoint\'s {was}: the run keeps {was} ({why}); '
                f'start a new run to change it.')
    used = [f'{flag(d)} {now} (was {was})' for d, (was, now) in diff.items()
            if CONTRACT[d][0] in (H, X, K) and d not in NOT_SHOWN]
    if used:
        say('Resumed with changed flags, used from here on: ' + ', '.join(used))
    return args
