"""The tuner: measured trials over the whole training step, a recommended command line, a scaling
forecast.

python dlojz.py --tune --arch resnet50 -b 64 --tune-budget 20      # on one device, before asking
for hours

Each trial is a dlojz process of its own (its own memory peak, its own compile cache), running the
user's flags for --tune-steps steady steps after warm-up, in test mode, writing into
<output-dir>/tune/<trial>:

1. batch size per device: doubling from -b until out of memory, over --tune-memory-gib (GPU memory
on a GPU, the process's host peak on CPU) or over --tune-max-batch, then bisection between the last
batch that fitted and the first that did not (to a multiple of 8); 2. at the largest batch that
fitted: precision x channels-last x compile, where valid on the device (CPU: fp32 and bf16 autocast,
channels-last on and off, compile off: inductor's CPU compile of a ResNet takes minutes on a small
machine; GPU: fp32, bf16 where supported, fp16, channels-last on and off, compile off and default,
and with channels-last the CUDA graphs of --compile-mode reduce-overhead);
3. the loader: a trial that comes out loader-bound says so, and if the loader doctor has run
(<output-dir>/tune-loader.json, from --tune-loader) its best setting is used for the trials after
it.

The winner (most images per second) gives the recommended command line: the user's flags and the
winning ones, with its expected epoch time and the learning rate the linear scaling rule gives the
new batch. The scaling forecast (measure.scaling) from the winner's trial follows. tune.json
(rewritten after every trial: a preempted --tune continues its table) and tune.csv go to
--output-dir. --tune-budget MIN bounds the whole sweep, resumed parts included: a trial that would
not finish in what is left is skipped and listed.

dlojz.py calls tune_mode once it has taken the run folder (its flags are in
flags.get_args_parser()); this module never imports dlojz.py."""
import os
import sys
import time

from dlojzlib import SCRIPT, choices, formats, readers, tables
from dlojzlib.dist import plan
from dlojzlib.errors import UsageError
from dlojzlib.flags import get_args_parser
from dlojzlib.measure import scaling
from dlojzlib.modes.trial import run_for_summary
from dlojzlib.readers import Unreadable
from dlojzlib.record.log import SUMMARY_VERSION, Console, write_json
from dlojzlib.record.rundir import run_files, run_record

# flags the tuner sets itself in each trial, left out of the user's flags it passes on
TRIAL_FLAGS = ('tune', 'tune_budget', 'tune_steps', 'tune_memory_gib', 'tune_max_batch', 'tune_machine',
               'tune_loader', 'loader_only', 'output_dir', 'run_name', 'test', 'test_nsteps', 'overwrite', 'resume',
               'batch_size', 'amp', 'channels_last', 'compile', 'compile_mode', 'warmup_steps',
               'wandb', 'chkpt', 'epochs')
# and those the recommended command replaces or leaves out (a run of its own: its folder, no resume)
RECOMMEND_DROP = ('tune', 'tune_budget', 'tune_steps', 'tune_memory_gib', 'tune_max_batch', 'tune_machine',
                  'tune_loader', 'loader_only', 'output_dir', 'overwrite', 'resume', 'batch_size', 'amp',
                  'channels_last', 'compile', 'compile_mode')
ROUND = 8  # bisection stops at batches a multiple of this apart: smaller steps change little


def check_tune_args(args, world_size):
    """One sentence per refusal."""
    if world_size > 1:
        raise UsageError('--tune runs its trials one at a time on one device; launch it without torchrun/srun '
                         'tasks (a single process), then use the forecast for more GPUs.')
    if args.tune_budget <= 0 or args.tune_steps < 1 or args.tune_max_batch < args.batch_size:
        raise UsageError('--tune needs --tune-budget > 0 minutes, --tune-steps >= 1 and --tune-max-batch >= -b.')


# ------------------------------------------------------------------------------------------ the trials

def configurations(cuda, bf16=True, shard='none', fp16=True):
    """(amp, channels_last, compile) combinations valid on the device, the default first; compile
    is False (eager) or a --compile-mode: 'default', and with channels-last 'reduce-overhead'
    (inductor's kernels replayed as CUDA graphs: the host's launch time off the step). Under --shard
    gradients and full, those the mode takes: neither channels-last, nor fp16, nor compile
    (dist.plan's refusals). fp16: whether the device takes it (a CPU under DLOJZ_AS_IF_CUDA sweeps
    the GPU's configurations without it)."""
    if not cuda:  # autocast on CPU is bf16 only; compile left out (minutes per trial on a small CPU)
        every = [(a, cl, False) for a in ('off', 'bf16') for cl in (False, True)]
    else:
        amps = ['off'] + (['fp16'] if fp16 else []) + (['bf16'] if bf16 else [])
        every = [(a, cl, c) for a in amps for cl in (True, False)
                 for c in (False, 'default', *(('reduce-overhead',) if cl else ()))]
    if shard in plan.FSDP_MODES:
        return [(a, cl, c) for a, cl, c in every if not cl and a != 'fp16' and not c]
    return every


def compile_mode(compile_):
    """A trial's compile as a --compile-mode, None for eager (True: 'default', as tune.json
    recorded it before modes were tried)."""
    return None if not compile_ else 'default' if compile_ is True else compile_


def trial_name(batch, amp, channels_last, compile_):
    mode = compile_mode(compile_)
    kind = 'eager' if mode is None else 'compile' if mode == 'default' else f'compile-{mode}'
    return f"b{batch}-{amp}-{'cl' if channels_last else 'nchw'}-{kind}"


def trial_argv(batch, amp, channels_last, compile_):
    mode = compile_mode(compile_)
    compiled = {None: ['--no-compile'], 'default': ['--compile']}.get(
        mode, ['--compile', '--compile-mode', mode])
    return ['-b', str(batch), '--amp', amp, '--channels-last' if channels_last else '--no-channels-last',
            *compiled]


def run_trial(python, script, base, argv, out, steps, warmup=3):
    """One trial in its own process -> its summary.json (None if it wrote none) and its exit code."""
    # -e: enough epochs that a small dataset holds the trial's steps (test mode stops at --test-nsteps)
    cmd = [python, script, *base, *argv, '--test-nsteps', str(warmup + steps), '--warmup-steps', str(warmup),
           '-e', '1000', '--wandb', 'off', '--overwrite', '--output-dir', out]
    return run_for_summary(cmd, out)


# A completed trial's summary.json as row_from reads it: formats.SUMMARY, with its rate
TRIAL_SUMMARY = readers.require(formats.SUMMARY, 'timing', 'timing.steady_images_per_s', 'memory',
                                'data')


def row_from(summary, code, last_line, batch, amp, channels_last, compile_, cuda):
    """A table row from a trial's summary.json (TRIAL_SUMMARY). Reads: status,
    timing.steady_images_per_s (images / steady time), timing.stats.step.mean,
    timing.stats.backward.mean, timing.bound, memory.gpu_max_allocated_bytes (GPU) or
    memory.host_peak_rss_bytes (CPU), data.train_images."""
    row = {'batch': batch, 'amp': amp, 'channels_last': channels_last, 'compile': compile_, 'status': None,
           'images_per_s': None, 'step_ms': None, 'backward_ms': None, 'memory_bytes': None, 'bound': None,
           'train_images': None}
    status = (summary or {}).get('status')
    if status != 'completed':
        row['status'] = status or f'exit {code}'
        row['error'] = (summary or {}).get('error') or last_line
        return row
    try:
        summary = TRIAL_SUMMARY.check(summary, '')
    except readers.Wrong as e:  # a trial's own record, of another shape: not a measurement
        row.update(status='damaged', error=f'its summary.json {e}')
        return row
    t, m = summary['timing'], summary['memory']
    stats = t.get('stats') or {}
    row.update(status='completed', images_per_s=t['steady_images_per_s'],
               step_ms=((stats.get('step') or {}).get('mean') or 0) * 1e3,
               backward_ms=((stats.get('backward') or {}).get('mean') or 0) * 1e3,
               memory_bytes=m.get('gpu_max_allocated_bytes') if cuda else m.get('host_peak_rss_bytes'),
               bound=t.get('bound'), train_images=summary['data'].get('train_images'),
               classes=summary['data'].get('classes'))
    return row


def fits(row, memory_budget):
    return row['status'] == 'completed' and row['images_per_s'] and \
        (memory_budget is None or (row['memory_bytes'] or 0) <= memory_budget)


def next_batch(tried, start, cap):
    """The batch schedule: doubling from `start` while every batch fits (and stays <= cap), then bisection
    between the largest that fitted and the smallest that did not, to ROUND. tried: {batch: fitted?}.
    -> the next batch to try, or None when the largest fitting batch is known."""
    ok = [b for b, f in tried.items() if f]
    bad = [b for b, f in tried.items() if not f]
    if start not in tried:
        return start
    if not ok:
        return None  # even -b does not fit: nothing smaller is tried (the user chose it)
    lo = max(ok)
    hi = min([b for b in bad if b > lo], default=None)
    if hi is None:
        return None if lo * 2 > cap else lo * 2
    mid = (lo + hi) // 2 // ROUND * ROUND
    return mid if lo < mid < hi else None


# tune.json as a continued sweep reads it: each row of its table (row_from and Tuner.trial write
# them) whole, as the table, the winner and the recommended command read them
ROW = ('name', 'batch', 'amp', 'channels_last', 'compile', 'status', 'wall_s')
MEASURED = ('images_per_s', 'step_ms', 'memory_bytes', 'bound', 'train_images')  # None: failed
TUNE = readers.present(readers.require(formats.TUNE, 'trials', *(f'trials.{k}' for k in ROW)),
                       *(f'trials.{k}' for k in MEASURED))


def aside_name(path):
    """<path>.damaged, or .damaged.2, .3, ...: the first free one (one kept earlier stays)."""
    name, k = f'{path}.damaged', 1
    while os.path.lexists(name):
        k += 1
        name = f'{path}.damaged.{k}'
    return name


class Tuner:
    """The sweep, its record (tune.json, rewritten after every trial) and its budget clock."""

    def __init__(self, args, base, cuda, say, runner, clock=time.monotonic, bf16=True, fp16=True,
                 gpu_memory=None):
        self.args, self.base, self.cuda, self.say, self.runner, self.clock = args, base, cuda, say, runner, clock
        self.bf16, self.fp16 = bf16, fp16
        # the trials' peak: the GPU's, or the host's (a CPU, under the seam too)
        self.gpu_memory = cuda if gpu_memory is None else gpu_memory
        self.path = os.path.join(args.output_dir, 'tune.json')
        self.memory_budget = args.tune_memory_gib * 2 ** 30 if args.tune_memory_gib else None
        self.record = self._load()
        self.t0 = clock()
        self.loader_flags = []

    def _load(self):
        """A previous tune.json with the same user flags: its trials are kept (a preempted --tune
        continues)."""
        fresh = {'version': SUMMARY_VERSION, 'status': 'running', 'base_argv': self.base,
                 'steps_per_trial': self.args.tune_steps, 'trials': [], 'skipped': [],
                 'elapsed_s': 0.0}
        try:
            old = readers.read_json(self.path, TUNE)
        except FileNotFoundError:
            return fresh
        except (OSError, Unreadable) as e:
            # a tune.json this sweep cannot continue from (a FIFO included: renamed, never opened):
            # kept aside, never overwritten
            aside = aside_name(self.path)
            os.replace(self.path, aside)
            why = e.why if isinstance(e, Unreadable) else e.strerror
            self.say(f'Note: {self.path} is damaged ({why}); it is kept as {aside} and the sweep '
                     f'starts afresh.')
            return fresh
        if old.get('base_argv') == self.base and old.get('status') != 'completed':
            return {**fresh, **old}
        return fresh

    def elapsed(self):
        return self.record['elapsed_s'] + self.clock() - self.t0

    def _save(self):
        os.makedirs(self.args.output_dir, exist_ok=True)
        rec = dict(self.record, elapsed_s=self.elapsed())
        write_json(self.path, rec)

    def trial(self, batch, amp, channels_last, compile_):
        """The row of this configuration: from the record when it already ran, else measured now
        (None if the budget has no room for it: the trial is listed as skipped)."""
        name = trial_name(batch, amp, channels_last, compile_)
        for row in self.record['trials']:
            if row['name'] == name:
                return row
        done = [r['wall_s'] for r in self.record['trials']]
        guess = max(done) if done else 0.0  # the longest trial so far: a larger batch takes no less
        if self.elapsed() + guess > self.args.tune_budget * 60:
            if name not in self.record['skipped']:
                self.record['skipped'].append(name)
                self._save()
            return None
        out = os.path.join(self.args.output_dir, 'tune', name)
        t = self.clock()
        summary, code, last = self.runner(self.base + self.loader_flags + trial_argv(batch, amp, channels_last,
                                                                                     compile_), out)
        row = row_from(summary, code, last, batch, amp, channels_last, compile_, self.gpu_memory)
        row.update(name=name, wall_s=self.clock() - t, dir=out, loader_flags=list(self.loader_flags))
        self.record['trials'].append(row)
        self._save()
        shown = f"{row['images_per_s']:.1f} img/s, step {row['step_ms']:.1f} ms, bound {row['bound']}" \
            if row['status'] == 'completed' else f"{row['status']}: {row.get('error')}"
        self.say(f'trial {name}: {shown}')
        if row['bound'] == 'loader' and not self.loader_flags:
            self.loader_flags = doctor_flags(self.args.output_dir, self.say)
            self.say(f'trial {name} is loader-bound: ' + (
                f"the loader doctor's best setting ({' '.join(self.loader_flags)}) is used from here on"
                if self.loader_flags else 'run --tune-loader first (same flags) to find the loader setting that '
                                          'feeds it; the trials go on with the loader as given'))
        return row

    def sweep(self):
        a = self.args
        every = configurations(self.cuda, self.bf16, getattr(a, 'shard', 'none'), self.fp16)
        amp0, cl0 = every[0][:2]
        tried = {}
        while True:
            b = next_batch(tried, a.batch_size, a.tune_max_batch)
            if b is None:
                break
            row = self.trial(b, amp0, cl0, False)
            if row is None:
                break
            tried[b] = bool(fits(row, self.memory_budget))
        best_batch = max((b for b, f in tried.items() if f), default=None)
        if best_batch is not None:
            for amp, cl, comp in every:
                self.trial(best_batch, amp, cl, comp)
        self.record['status'] = 'completed'
        self._save()
        return self.record


def doctor_flags(output_dir, say=None):
    """The loader doctor's best setting (tune-loader.json of --tune-loader in the same folder), as
    flags; none when it has not run, or its record is damaged (`say` is told)."""
    path = os.path.join(output_dir, 'tune-loader.json')
    try:
        best = readers.read_json(path, formats.LOADER_BEST)['verdict']['best']
    except OSError:
        return []
    except Unreadable as e:
        if say:
            say(f"Note: {e}; the trials go on without the loader doctor's setting (run "
                f"--tune-loader again to remake it).")
        return []
    from dlojzlib.modes import doctor
    return doctor.trial_argv(best)


def winner(record, memory_budget=None):
    rows = [r for r in record['trials'] if fits(r, memory_budget)]
    return max(rows, key=lambda r: r['images_per_s'], default=None)


def recommendation(args, raw_argv, best, user_lr=None, world_size=1):
    """-> (command line, expected epoch seconds, learning-rate sentence) for the winning trial. user_lr: the
    --lr the user gave (None: dlojz derives it from --base-lr and the batch)."""
    epoch_s = best['train_images'] / (best['images_per_s'] * world_size) if best['train_images'] else None
    flags = list(raw_argv)
    if user_lr is not None:  # the user fixed it for -b: the rule scales it with the batch
        i = flags.index('--lr')
        del flags[i:i + 2]
        lr = user_lr * best['batch'] / args.batch_size  # same world size and accumulation
        flags += ['--lr', f'{lr:g}']
        rule = f'--lr {user_lr:g} was for -b {args.batch_size}: the linear scaling rule (Goyal et al. 2017) ' \
               f'makes it --lr {lr:g} at -b {best["batch"]}'
    else:
        images = best['batch'] * world_size * getattr(args, 'accum_steps', 1)
        rule = f'learning rate = --base-lr {args.base_lr:g} x {images} / 256 = {args.base_lr * images / 256:g} ' \
               f'(dlojz applies it from the batch)'
    cmd = ['python', 'dlojz.py', *flags, *best.get('loader_flags', []),
           *trial_argv(best['batch'], best['amp'], best['channels_last'], best['compile'])]
    return ' '.join(cmd), epoch_s, rule


def trials_table(rows):
    headers = ['batch', 'amp', 'channels-last', 'compile', 'img/s', 'step ms', 'memory GiB', 'bound', 'status']
    cells = []
    for r in rows:
        done = r['status'] == 'completed' and None not in (r['images_per_s'], r['step_ms'])
        measured = [f"{r['images_per_s']:.1f}", f"{r['step_ms']:.1f}", f"{(r['memory_bytes'] or 0) / 2**30:.2f}",
                    r['bound']] if done else ['-'] * 4
        cells.append([r['batch'], r['amp'], 'on' if r['channels_last'] else 'off',
                      compile_mode(r['compile']) or 'off', *measured, r['status']])
    return tables.markdown(headers, cells)


def grad_bytes(arch, classes):
    """Trainable parameters x 4 bytes, counted on the meta device (nothing allocated)."""
    import torch
    import custom_models
    with torch.device('meta'):
        model = custom_models.build_model(arch, classes)
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def forecast_lines(args, best, cuda, gpus=(1, 2, 4, 8, 16, 32)):
    machine = args.tune_machine or ('a100' if cuda else None)
    if not machine or not best.get('backward_ms'):
        return ['>>> Scaling forecast: give --tune-machine (a100, h100, v100, generic), or probe this machine: '
                'torchrun --nproc_per_node N dlojz_scaling.py --probe probe.json (docs/scaling.md).'], None
    link = scaling.machine_link(machine)
    per_node = link.ranks_per_node
    gpus = [g for g in gpus if g <= per_node or g % per_node == 0]
    rows = scaling.forecast(best['batch'] / best['images_per_s'], best['backward_ms'] / 1e3, best['batch'],
                                  grad_bytes(args.arch, best.get('classes') or 1000), link, gpus,
                                  args.bucket_cap_mb)
    return [f'>>> Scaling forecast on {machine} ({link.source}; model: docs/scaling.md, an upper bound):'] + \
        scaling.table(rows), rows


def write_csv(path, rows):
    tables.write_csv(path, ['name', 'batch', 'amp', 'channels_last', 'compile', 'status', 'images_per_s', 'step_ms',
                            'backward_ms', 'memory_bytes', 'bound', 'wall_s'], rows)


def run_tune(args, raw, parser, device, say, python=sys.executable, script=None, runner=None, bf16=None,
             world_size=1, choice=None):
    """--tune on one device -> the tune record (also in tune.json). raw: the flags as parsed, before
    defaults were resolved (what the user typed is what the trials and the recommendation repeat).
    choice: the device's choices.Choices (default: choices.of the device), whose sweep it runs; a
    trial runs in a process of its own, which makes its own (DLOJZ_AS_IF_CUDA is inherited).
    """
    check_tune_args(args, world_size)
    script = script or SCRIPT
    # dlojz refuses --amp bf16 below sm80 (and fp16 on a CPU): those trials would only be refused
    cuda, native, fp16 = (choice or choices.of(device)).tune_sweep()
    bf16 = native if bf16 is None else bf16
    base = _to_argv(parser, raw, TRIAL_FLAGS)
    runner = runner or (lambda argv, out: run_trial(python, script, [], argv, out, args.tune_steps))
    gpu = device.type == 'cuda'  # a trial's peak memory: the GPU's, else the host's
    tuner = Tuner(args, base, cuda, say, runner, bf16=bf16, fp16=fp16, gpu_memory=gpu)
    resumed = len(tuner.record['trials'])
    seam = ' (a GPU\'s sweep: DLOJZ_AS_IF_CUDA=1)' if cuda and not gpu else ''
    say(f'Tuning on {device}{seam}: {args.tune_steps} steady steps per trial, budget '
        f'{args.tune_budget:g} min'
        + (f'; {resumed} trials already measured (resumed)' if resumed else ''))
    record = tuner.sweep()
    best = winner(record, tuner.memory_budget)
    for line in trials_table(record['trials']):
        say(line)
    if record['skipped']:
        say(f">>> Skipped for the budget ({args.tune_budget:g} min): {', '.join(record['skipped'])}")
    if best is None:
        raise UsageError('no --tune trial completed: see the table; the first trial\'s own summary.json is in '
                         f"{os.path.join(args.output_dir, 'tune')}.")
    cmd, epoch_s, rule = recommendation(args, _to_argv(parser, raw, RECOMMEND_DROP), best, raw.get('lr'))
    say(f">>> Recommended: {cmd}")
    say(f">>> Expected: {best['images_per_s']:.1f} images/second"
        + (f', epoch {epoch_s:.1f} s on one device' if epoch_s else '') + f'; {rule}')
    lines, rows = forecast_lines(args, best, gpu)  # from a measured rate: the real device's
    for line in lines:
        say(line)
    record.update(recommended={'command': cmd, 'trial': best['name'], 'images_per_s': best['images_per_s'],
                               'epoch_time_estimate_s': epoch_s, 'lr_rule': rule}, forecast=rows)
    tuner.record = record
    tuner._save()
    write_csv(os.path.join(args.output_dir, 'tune.csv'), record['trials'])
    # the report (dlojz_report.py, "Tuning") reads run folders through their summary.json
    write_json(os.path.join(args.output_dir, 'summary.json'), {
        'version': SUMMARY_VERSION, 'status': 'completed', 'error': None, 'mode': 'tune', 'config': vars(args),
        'tune': record})
    return record


def holds_another_record(folder):
    """Whether `folder` holds something else than a --tune or the loader doctor it reuses (a
    training run's checkpoints, log or summary): a preempted --tune continues in its own folder,
    never in another run's."""
    summary = run_record(folder)
    return bool(set(run_files(folder)) - {'config.json', 'summary.json'}) or \
        (summary is not None and summary.get('mode') not in ('tune', 'tune-loader'))


def tune_mode(args, raw, dist, device, choice=None):
    """--tune as dlojz.py runs it, in the run folder it has taken: config.json, the sweep, where it
    went. choice: the device's choices.Choices."""
    if holds_another_record(args.output_dir):  # --resume auto (the slurm/ scripts') into a training run's folder
        raise UsageError(f'--output-dir {args.output_dir} holds a training run; --tune writes its trials and record '
                         f'into a folder of their own: pass another --output-dir or --run-name.')
    say = Console(dist.is_main)
    write_json(os.path.join(args.output_dir, 'config.json'), vars(args))
    record = run_tune(args, raw, get_args_parser(), device, say, world_size=dist.world_size,
                      choice=choice)
    say(f'Run written to {args.output_dir}')
    return record


def _to_argv(parser, raw, drop):
    """The user's flags, without those in `drop` (modes.doctor.to_argv with another list)."""
    from dlojzlib.modes import doctor
    saved = doctor._TRIAL_FLAGS
    doctor._TRIAL_FLAGS = drop
    try:
        return doctor.to_argv(parser, raw)
    finally:
        doctor._TRIAL_FLAGS = saved
