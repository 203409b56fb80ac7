"""What the scaling forecast (measure.scaling, dlojz_scaling.py) reads, and what makes its inputs a
forecast. summary.json's shape (--summary, --slowed-from, --measured, --pipeline) is
dlojzlib/formats.py's, with what the forecast needs there required below; a --probe JSON's
(--link) is declared here. Each is read through dlojzlib.readers. A file that cannot be used is
one sentence naming the flag, the file and the fix (ValueError, which dlojz_scaling.py prints as
its error line, exit 2).

A --slowed-from run must be a completed run of the same flags at more ranks than --summary's;
a forecast with a negative term or an efficiency above 100 % is a measurement problem (a busy
node, noise in a run), named as such, never printed as a forecast. Light: no torch at import."""
from dlojzlib import formats, readers
from dlojzlib.readers import Dict, Int, Num

MiB = 2 ** 20
MAX_BUCKETS = 10 ** 5  # DDP makes at most one bucket per parameter tensor: a few hundred in dlojz

# summary.json as dlojzlib/formats.py declares it, with what the forecast needs there: the run's
# world size and batch, and a phase's totals and a rank's sums whole where they are recorded
SUMMARY = readers.require(formats.SUMMARY, 'world_size', 'global_batch',
                          'timing.totals.steady_steps', 'timing.totals.wall_s',
                          'timing.totals.data_s', 'timing.ranks.steady_steps')

# dlojz_scaling.py --probe's output (scaling._probe_main); a link written by hand needs only the fit
PROBE = Dict({'world_size': Int(2, 10 ** 6), 'bandwidth': Num(1), 'latency': Num(0, 60)},
             optional=['world_size'])

# A --pipeline-stages run's summary.json: what stages.forecast_rows reads
PIPELINE = readers.require(formats.SUMMARY, 'global_batch', 'timing', 'timing.steady_images_per_s',
                           'timing.pipeline', 'timing.pipeline.n_stages',
                           'timing.pipeline.microbatches', 'timing.pipeline.schedule',
                           'timing.pipeline.span_s', 'timing.pipeline.stages',
                           'timing.pipeline.stages.compute_s')

WHAT = {'--summary': 'the summary.json of a one-rank dlojz run (under torchrun or srun)',
        '--slowed-from': 'the summary.json of a completed dlojz run of the same flags at 2 or '
                         'more ranks',
        '--measured': 'the summary.json of a dlojz run',
        '--link': 'the JSON that torchrun --nproc_per_node 2 dlojz_scaling.py --probe '
                  'probe.json writes',
        '--pipeline': 'the summary.json of a completed --pipeline-stages run with --timing'}


def read(flag, path, shape):
    """`flag`'s file -> a value of `shape`; ValueError: one sentence naming the flag, the file
    and what to give instead. Never blocks: a FIFO, a folder or a device is refused."""
    try:
        return readers.read_json(path, shape)
    except FileNotFoundError:
        why = 'does not exist'
    except readers.Unreadable as e:
        why = e.why
    except OSError as e:
        why = f'cannot be read ({e.strerror or e})'
    raise ValueError(f'{flag} {path} {why}; give {WHAT[flag]}.') from None


# The flags that change a rank's work per step: two runs that differ in one of them measure two
# different steps. The world size, the launcher, the learning rate (scaled with the global batch),
# the output folder, the number of steps are not among them.
WORK_FLAGS = ('arch', 'batch_size', 'image_size', 'res_start', 'res_end_epoch', 'amp',
              'channels_last', 'compile', 'compile_mode', 'grad_checkpointing', 'accum_steps',
              'optimizer', 'ema_decay', 'sync_bn', 'shard', 'cpu_offload', 'bucket_cap_mb',
              'static_graph', 'gradient_as_bucket_view', 'find_unused_parameters',
              'broadcast_buffers', 'pipeline_stages', 'microbatches', 'tf32', 'deterministic',
              'cudnn_benchmark', 'sd_prob', 'n_heads', 'mixup', 'cutmix', 'decode', 'loader',
              'num_workers', 'device', 'sync_timing', 'prof')


def option(name):
    return '-b' if name == 'batch_size' else '--' + name.replace('_', '-')


def check_slowed_from(reference, ref_path, other, path):
    """ValueError (one sentence) unless `other` is a completed run of the flags of `reference`
    (the one-rank run) at more ranks. Flags only one of the two records (another dlojz version)
    are not compared."""
    ranks = other['world_size']
    if ranks <= reference['world_size'] or ranks < 2:
        raise ValueError(f'--slowed-from needs a run at 2 or more ranks of the same flags; '
                         f'{path} has {ranks} rank(s).')
    status = other.get('status')
    if status != 'completed':
        ended = f'ended {status!r}' if status else 'records no status'
        raise ValueError(f'--slowed-from {path} is a run that {ended}, not \'completed\': its '
                         f'times are not those of a whole run; give {WHAT["--slowed-from"]}.')
    mine, theirs = reference.get('config'), other.get('config')
    if mine is None or theirs is None:
        which = f'--summary {ref_path}' if mine is None else f'--slowed-from {path}'
        raise ValueError(f'{which} records no flags (no config in its summary.json), so the two '
                         f'runs cannot be compared; give summary.json files that dlojz wrote.')
    differ = [f'{option(k)} {theirs[k]} (not {mine[k]})' for k in WORK_FLAGS
              if k in mine and k in theirs and mine[k] != theirs[k]]
    if differ:
        raise ValueError(f'--slowed-from {path} is a run of other flags than --summary '
                         f'{ref_path}: {", ".join(differ)}; give a run of the same flags at 2 or '
                         f'more ranks (only the launcher and the world size may differ).')


def check_buckets(grad_bytes, bucket_cap_mb):
    """ValueError where --bucket-cap-mb would split the gradients into more buckets than DDP
    makes (bucket_sizes would list them one by one)."""
    if grad_bytes > MAX_BUCKETS * bucket_cap_mb * MiB:
        raise ValueError(f'--summary\'s config.bucket_cap_mb {bucket_cap_mb} splits '
                         f'{grad_bytes / MiB:.0f} MiB of gradients into more than {MAX_BUCKETS} '
                         f'buckets, more than DDP makes (one per parameter at most); give the '
                         f'summary.json dlojz wrote.')


def check_work(flag, path, work_s):
    """ValueError where a run's work per step (busy time less waits in collectives, seconds) is
    not above 0: no fraction of it can be taken."""
    if work_s is not None and work_s <= 0:
        raise ValueError(f'{flag} {path} measured no work per step (its busy time is no longer '
                         f'than its waits in collectives: {work_s * 1e3:+.2f} ms a step): a '
                         f'measurement problem, most likely a busy node; measure the run again '
                         f'on an idle node with more steps (--test-nsteps).')


TERMS = (('slowed_s', 'compute slowed'), ('straggler_s', 'straggler'),
         ('exposed_s', 'exposed communication'))


def measurement_problem(rows, source):
    """The forecast rows no forecast can hold (a term below 0, an efficiency above 100 %) -> one
    sentence naming the first, what was measured (`source`: where the compute slowed term comes
    from) and what to do; None where every row is a forecast."""
    for r in rows:
        negative = [(name, r[key]) for key, name in TERMS if r.get(key, 0.0) < 0]
        if negative or r['efficiency'] > 1:
            name, value = negative[0] if negative else ('sum of the terms', 0.0)
            return (f'the forecast at {r["gpus"]} GPUs has a {name} term of '
                    f'{value * 1e3:+.2f} ms a step and an efficiency of {r["efficiency"]:.1%} '
                    f'(compute slowed: {source}): a measurement problem, not a forecast, most '
                    f'likely a busy node or noise in one of the runs; measure them again on an '
                    f'idle node with more steps (--test-nsteps).')
    return None

