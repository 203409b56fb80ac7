"""dlojz: train torchvision ResNets on ImageNet (or a built-in JPEG dataset) and measure why a run is
fast or slow.

    python dlojz.py --test-nsteps 20 --arch resnet18 --image-size 64 -b 16 --num-workers 2   # CPU demo
    python dlojz.py --test-nsteps 50 --amp bf16 --channels-last --data-dir /path/imagenet      # one GPU
    torchrun --standalone --nproc_per_node 4 dlojz.py --test-nsteps 50 --amp bf16              # 4 GPUs, DDP
    torchrun --standalone --nproc_per_node 4 dlojz.py --arch coatnet7 --shard full  # 4 GPUs, ZeRO-3
    srun --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=10 python dlojz.py --num-workers 10  # SLURM, DDP
    sbatch slurm/jz-a100-8gpu.slurm --amp bf16 -b 256                      # batch job, requeued on SIGUSR2

Outputs go to --output-dir (default runs/<job id or timestamp>_<arch>_bs<b>): config.json,
metrics.jsonl, summary.json, checkpoint-<step>.pt (--chkpt), profiler traces (--prof), wandb files.

Reading order: flags (dlojzlib/flags.py) -> builders -> train_step and the loops (train, validation)
-> main; docs/development.md lists every module (run folder, checkpoints, sharding, modes, summary).
"""
import argparse
import itertools
import math
import os
import random
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

from dlojzlib import flags
from dlojzlib.flags import get_args_parser  # noqa: F401 (dlojz.get_args_parser: the tests' and tune_loader's way in)

# Stop signals from the first line: before the first step one ends the start-up (a light module)
from dlojzlib.dist import starting
from dlojzlib.errors import EARLY_SIGNALS  # noqa: E402 - a light module; dist.launch.stop_received() reads it too

if __name__ == '__main__':  # flags first: --help and usage errors answer before torch is imported (seconds)
    starting.install_early()
    flags.parse_or_exit()

import numpy as np
import torch
import torch.nn as nn

import custom_models
from dlojz_chrono import Chronometer, CudaTimeline, profiler
from dlojzlib import choices
from dlojzlib import failpoints
from dlojzlib import recipe
from dlojzlib.data import augment
from dlojzlib.data import datasets
from dlojzlib.data.datasets import build_data
from dlojzlib.dist import launch, pipeline, shard
from dlojzlib.dist.launch import get_dist_info
from dlojzlib.errors import (CommFailure, DiskFull, DlojzError, Interrupted, NonFiniteValidation,
                             report_error, translate)
from dlojzlib.host import freeze_imports, host_check, intra_op_threads, process_start_time
from dlojzlib.measure.bubble import StageTimer
from dlojzlib.measure.comm import CommTimer
from dlojzlib.measure.memory import capacity, plan_run
from dlojzlib.measure.power import PowerMeter
from dlojzlib.measure.startup import StartUp
from dlojzlib.metrics import Meters, NonFiniteGuard, PeakMemory, log_train, log_train_metrics
from dlojzlib.modes import doctor
from dlojzlib.modes import tune
from dlojzlib.record import resume
from dlojzlib.record import rundir
from dlojzlib.record.log import Console, Logger, build_wandb, console_lines, write_json
from dlojzlib.record.rundir import trim_metrics
from dlojzlib.record.state import (Progress, check_form, check_resume, find_resume_checkpoint, interrupted, note_validation,
                         preempt, process_wall_s, restore, run_wall_s, save)
from dlojzlib.record.summary import final_lines, print_header, stop_recorded, write_summary


# ----------------------------------------------------------------- flags (flags checks them)

def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ building

def build_model(args, num_classes, device, dist, comm=None, phase=lambda name: nullcontext(),
                pipe=None):
    """-> (model to train: DDP-wrapped and/or compiled, model to evaluate, plain module for state dicts).

    Validation runs the module without its DDP wrapper: a DDP forward may broadcast buffers (a collective),
    and ranks can run different numbers of validation batches. `comm`: a measure.comm.CommTimer to time the
    gradient all-reduce with. pipe(model): --pipeline-stages' cut (dist.pipeline), the model to
    evaluate."""
    model = custom_models.build_model(args.arch, num_classes, args.sd_prob, args.n_heads,
                                      args.image_size)
    if args.grad_checkpointing:
        custom_models.apply_grad_checkpointing(model)
    if pipe is not None:  # this rank's stages: the rest of the model never reaches the device
        return model, pipe(model), model
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    fsdp = args.shard in shard.FSDP_MODES  # FSDP2 moves each rank's slices to the device, not all
    model = model.to(None if fsdp else device, memory_format=memory_format)
    if dist.distributed and args.sync_bn:  # before the DDP wrap, as DDP must see the final modules
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    with phase('ddp_wrap'):  # its first broadcast of the weights
        if fsdp:
            train_model = shard.apply_fsdp(model, custom_models.blocks(model), device,
                                           args.shard == 'full', args.cpu_offload, comm)
        else:
            train_model = launch.wrap_ddp(model, device, args, comm) if dist.distributed else model
    eval_model = model
    if args.compile:  # DDP first, then compile: dynamo's DDPOptimizer keeps communication overlapped
        # Static shapes: an epoch's smaller last batch gets its own graph (compiled once, outside the
        # statistics), instead of turning every later step into a slower dynamic-shape graph.
        kw = dict(mode=None if args.compile_mode == 'default' else args.compile_mode, dynamic=False)
        train_model = torch.compile(train_model, **kw)
        eval_model = torch.compile(model, **kw) if dist.distributed else train_model
    return train_model, eval_model, model


@dataclass(kw_only=True)
class Run:
    """What a run is built from; none of it changes while the loops run (their state is a Progress)."""
    args: argparse.Namespace
    dist: launch.DistInfo
    device: torch.device
    data: object                  # data.datasets.Data: loaders, classes, counts
    model: nn.Module              # what trains: DDP-wrapped and/or compiled; a pipeline's part
    eval_model: nn.Module         # what validates: without the DDP wrapper
    model_without_ddp: nn.Module  # plain module: state dicts, buffers
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    autocast: object              # torch.autocast, or nullcontext with --amp off
    norm: tuple                   # ImageNet mean and std x 255 on the device, (1, 3, 1, 1): made once
    chrono: Chronometer
    power: PowerMeter             # NVML energy: whole run, and steady training windows for J/image
    memory: PeakMemory            # peak memory, reset after the warm-up steps
    guard: NonFiniteGuard
    stop: launch.StopSignal
    log: Logger
    global_batch: int
    host: dict                    # cores, load, threads, workers (host.host_check)
    steps_per_epoch: int
    total_steps: int              # of this invocation's schedule: --findlr's sweep length
    mix: object = None            # data.augment.Mix: --mixup / --cutmix on the device (identity when off)
    ema: object = None            # recipe.EMA with --ema-decay
    started: float = 0.0          # time.time() when the run was built: time to accuracy counts from here
    process_started: float = 0.0  # time.time() when the process started: the second clock, start-up included
    startup: StartUp = None       # the time to the first step, by phase (measure.startup)
    plans: dict = None            # model states per rank of each --shard mode (memory.plan_run)
    states: shard.StateMeter = None  # this rank's, measured after the first optimizer step
    pipe: pipeline.Pipeline = None  # --pipeline-stages or --microbatches: the steps go through it
    replicas: int = 1             # of the data: the ranks, or the copies of a pipeline
    choices: object = None        # choices.Choices: what it picked from its device


def build_run(args, dist, device, say, startup=None, choice=None):
    """-> (run, where it starts). The checkpoint's flags are settled first (record.resume: the seed, for one, shapes
    the data order), and the checkpoint is checked against the run before any log is opened. choice:
    the device's choices.Choices (check_args resolved the flags with it; default: choices.of the
    device)."""
    choice = choice or choices.of(device)
    startup = startup or StartUp(time.time())
    phase = startup.phase
    with phase('checkpoint'):
        ckpt_path, ckpt = find_resume_checkpoint(args, dist, say)
        if ckpt is not None:
            check_form(args, ckpt, ckpt_path)
            if not args.evaluate:
                resume.resolve(args, ckpt.get('args') or {}, say)
    replicas = dist.world_size // args.pipeline_stages  # a pipeline's stages read the same batches
    with phase('loaders'):
        data = build_data(args, pipeline.data_view(dist, replicas), log=say,
                          on_ranks=launch.on_ranks, device=device, phase=phase)
    say(f'Data: {data.source.kind} {data.source.root} ({data.source.reason}); {data.n_train} train / '
        f'{data.n_val} val images, {len(data.classes)} classes')
    amp_dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(args.amp)
    autocast = lambda: torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    comm = CommTimer(dist.world_size, CudaTimeline(device) if device.type == 'cuda' else None) \
        if dist.distributed and args.timing else None
    # planned on the meta device first (shapes only): a mode that cannot fit is refused
    with phase('model'):
        plans = plan_run(args, lambda: custom_models.build_model(
            args.arch, len(data.classes), args.sd_prob, args.n_heads, args.image_size),
            custom_models.blocks, dist.world_size, capacity(device), say)
        cut = (ckpt or {}).get('pipeline')  # a resumed pipeline keeps its cut
        pipe = (lambda m: pipeline.build(args, m, device, dist, autocast(), say, cut, comm)) \
            if pipeline.wanted(args) else None
        model, eval_model, plain = build_model(args, len(data.classes), device, dist, comm, phase,
                                               pipe)
    steps_per_epoch = len(data.train_steps)
    total_steps = args.epochs * steps_per_epoch
    if args.test and args.test_nsteps > total_steps:
        say(f'Note: --test-nsteps {args.test_nsteps} is more than {args.epochs} epoch(s) of {steps_per_epoch} steps '
            f'hold: running {total_steps} steps; raise -e to run more.')
    total_steps = min(args.test_nsteps, total_steps) if args.test else total_steps
    if len(data.classes) == 1:
        say(f'Warning: the data has a single class ({data.classes[0]}): every prediction is right, loss and '
            f'accuracy say nothing; check --data-dir.')
    with phase('optimizer'):
        criterion, optimizer, scheduler, scaler = recipe.build_optimization(
            args, plain, steps_per_epoch, total_steps, choice)
    global_batch = args.batch_size * replicas * args.accum_steps
    check_resume(args, dist, ckpt_path, ckpt, data, plain, optimizer, global_batch, steps_per_epoch, total_steps)
    resumed = ckpt is not None and not args.evaluate
    metrics = os.path.join(args.output_dir, 'metrics.jsonl')
    dropped = None
    if resumed and dist.is_main and os.path.samefile(os.path.dirname(os.path.abspath(ckpt_path)), args.output_dir):
        # the steps logged after the checkpoint are run again: their records are written again, not repeated
        dropped = trim_metrics(metrics, ckpt.get('metrics_bytes'), ckpt['global_step'])
    chrono = Chronometer(device, phases=args.timing, sync=args.sync_timing, warmup=args.warmup_steps)
    with phase('logs_and_meters'):  # NVML's start, wandb's, the host's check
        power, memory = PowerMeter(device, gather=launch.all_gather_object), PeakMemory(device)
        log = Logger(metrics, say, append=resumed, lines=console_lines(args, steps_per_epoch),
                     wandb=build_wandb(args, dist))
        host = host_check(args.num_workers, device.type == 'cpu')
    chrono.on_steady += [memory.reset, power.window_start]  # once the warm-up steps are over
    chrono.comm = comm
    if getattr(eval_model, 'stages', None):  # a pipeline's schedule: its stages' chunks
        chrono.pipe = StageTimer(device).attach(eval_model)
    run = Run(args=args, dist=dist, device=device, data=data, model=model, eval_model=eval_model,
              model_without_ddp=plain, criterion=criterion, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
              autocast=autocast(),
              norm=datasets.normalisation(device),
              chrono=chrono, power=power, memory=memory,
              # a non-finite loss is looked for every step on CPU (free); on a GPU at each log line, in the
              # same read as the line's loss (one sync per --log-interval steps); the LR sweep reads its loss
              # every step anyway and stops on its own
              guard=NonFiniteGuard(device, choice.nan_check_every(args.findlr), dist.distributed,
                                   comm),
              stop=launch.StopSignal(),
              log=log, global_batch=global_batch, host=host,
              steps_per_epoch=steps_per_epoch, total_steps=total_steps,
              mix=augment.Mix(args.mixup, args.cutmix, len(data.classes), args.seed),
              ema=recipe.EMA(plain, args.ema_decay, args.ema_warmup) if args.ema_decay else None,
              started=time.time(), process_started=process_start_time(), startup=startup,
              plans=plans, states=shard.StateMeter(plain, optimizer), replicas=replicas,
              pipe=eval_model if isinstance(eval_model, pipeline.Pipeline) else None,
              choices=choice)
    sync = recipe.scaler_sync_warning(optimizer, args.amp)
    run.host['warnings'] += [sync] if sync else []  # printed in the header, kept in summary.json
    if resumed:  # where this attempt starts, and what it replaced of the one before
        run.log.log(type='resume', global_step=ckpt['global_step'], checkpoint=ckpt_path, dropped_records=dropped)
    with phase('restore'):
        return run, restore(run, ckpt, ckpt_path) if ckpt is not None else Progress()


# ------------------------------------------------------------------------------------------------ training

def to_device(images, labels, run):
    """uint8 NCHW batch -> normalised float on the device (data.datasets.to_device)."""
    return datasets.to_device(images, labels, run.device, run.norm, run.args.non_blocking,
                              run.args.channels_last)


def train_step(run, images, labels):
    """One optimisation step, as every mode runs it: the gradients (accumulate's, or a pipeline's
    schedule: dist.pipeline), then the optimizer. -> (mean loss, output, labels): detached, on the
    device."""
    starting.disarm()  # a step begins: from here a stop signal waits for its end
    loss, output, target = accumulate(run, images, labels) if run.pipe is None else \
        run.pipe.gradients(run, images, labels, to_device)  # --pipeline-stages, --microbatches
    with run.chrono.phase('optimizer'):
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if run.ema is not None:
        run.ema.update(run.model_without_ddp)
    return loss, output, target


def accumulate(run, images, labels):
    """The gradients of a batch or (--accum-steps) lists of micro-batches, which add up: each
    micro-batch's loss is divided by their number, so the step follows the mean over all its
    images, as N ranks' all-reduce would; DDP syncs only during the last backward (no_sync
    before). -> (mean loss, output, labels)."""
    micro = list(zip(images, labels)) if isinstance(images, list) else [(images, labels)]
    n = len(micro)
    losses, outputs, targets = [], [], []
    for k, (x, y) in enumerate(micro):
        with shard.no_sync(run.model) if k < n - 1 and run.dist.distributed else nullcontext():
            with run.chrono.phase('h2d'):
                x, y = to_device(x, y, run)
                # soft targets with --mixup/--cutmix, drawn for (optimizer step, virtual rank); the meters keep y
                x, target = run.mix(x, y, run.scheduler.last_epoch, run.dist.rank * n + k)
            with run.chrono.phase('forward'), run.autocast:
                output = run.model(x)
                loss = run.criterion(output, target)
            # copies with several micro-batches: CUDA graphs (--compile-mode reduce-overhead) reuse outputs
            losses.append(loss.detach() if n == 1 else loss.detach().clone())
            if k == n - 1:  # before the last backward: a non-finite loss it reads is never applied
                run.guard.observe(loss if n == 1 else torch.stack(losses).sum())
            with run.chrono.phase('backward'):
                run.scaler.scale(loss / n if n > 1 else loss).backward()
        outputs.append(output.detach() if n == 1 else output.detach().clone())
        targets.append(y)
    if n == 1:
        return losses[0], outputs[0], targets[0]
    return torch.stack(losses).mean(), torch.cat(outputs), torch.cat(targets)


def train(run, progress, prof=None):
    """Epochs from where progress stands: train, then close the epoch (validation, best.pt, checkpoint). With
    --test, --test-nsteps steps in all, a resumed run's earlier steps included, then a short validation. A stop
    signal ends it through preempt(): during training at the next step boundary (a stop during an epoch's
    last step leaves a checkpoint that owes the epoch's validation, which the resumed run runs first); during
    the closing of an epoch, once it is done."""
    args = run.args
    while progress.epoch < args.epochs:
        if not progress.end_due:
            left = args.test_nsteps - progress.global_step if args.test else None
            if left is not None and left <= 0:  # resumed from the end of a --test-nsteps run
                break
            first = progress.step
            run.data.set_epoch(progress.epoch, first * args.batch_size)
            if train_one_epoch(run, progress, left, prof):  # it sets end_due when the epoch or --test-nsteps ends
                preempt(run, progress)
        close_epoch(run, progress)
        over = progress.epoch >= args.epochs or (args.test and progress.global_step >= args.test_nsteps)
        if not over and stop_now(run):  # a signal during the validation
            preempt(run, progress)
        if args.chkpt:  # after the validation: it holds the best top-1 and time to accuracy so far
            save(run, progress)


def close_epoch(run, progress):
    """The end of an epoch or of --test-nsteps: validation when due (every --val-every epochs, after the last
    and at the end of --test-nsteps), then the position moves to the next epoch, then best.pt (which so holds
    a closed epoch)."""
    args = run.args
    epoch_end = progress.step == run.steps_per_epoch  # else --test-nsteps ended mid-epoch (this run's or the last)
    last = (epoch_end and progress.epoch == args.epochs - 1) or (args.test and progress.global_step >= args.test_nsteps)
    validate = last or (epoch_end and not args.test and (progress.epoch + 1) % args.val_every == 0)
    if validate:
        progress.val = evaluate(run, progress.epoch, progress, 20 if args.test else None)
        if run.ema is not None:
            progress.val_ema = evaluate(run, progress.epoch, progress, 20 if args.test else None, ema=True)
    if epoch_end:
        progress.epoch, progress.step = progress.epoch + 1, 0
    progress.end_due = False
    if validate:
        note_validation(run, progress)


def stop_now(run):
    """Whether a stop signal reached any rank: agreed() starts the agreement, settle() waits for it (blocking:
    between epochs only; alone, agreed() answers a step later)."""
    return run.stop.agreed() or run.stop.settle()


def train_one_epoch(run, progress, max_steps=None, prof=None):
    """Train from progress.step to the end of the epoch, or for max_steps steps; -> True when a stop signal
    ended it early. Each step: step -> meters -> log line -> checkpoint -> stop check."""
    args, first = run.args, progress.step
    run.model.train()
    run.guard.reset(progress.global_step)
    meters = Meters(len(run.data.classes), run.device)
    window = torch.zeros((), device=run.device)  # loss summed since the last log line, read there only
    t_log, stopped = time.perf_counter(), False
    images_before = run.chrono.images_after_warmup
    if len(run.chrono.steps) >= run.chrono.warmup:  # past the warm-up (a later epoch): this epoch's steps count for J/image
        run.power.window_start()
    bar = run.log.bar(min(run.steps_per_epoch - first, max_steps or run.steps_per_epoch), f'epoch {progress.epoch + 1}')
    batches = run.startup.first_batch(run.data.train_steps)  # the first wait: the loader's start
    for images, labels in run.chrono.iterate(batches, max_steps):
        if args.nccl_debug:  # the course's comm_profiler marker: tags the NCCL lines that follow
            print(f'Train step {progress.global_step + 1} - rank {run.dist.rank}', flush=True)
        lr = run.optimizer.param_groups[0]['lr']
        loss, output, labels = train_step(run, images, labels)
        if run.startup.pending:  # this process's first step ends its start-up (one GPU sync)
            run.startup.first_step_done(run.device)
        progress.advance(labels.shape[0] * run.replicas)  # every replica's batch has this size
        # the epoch's (or --test-nsteps') last step: a checkpoint from here on owes the closing validation
        progress.end_due = progress.step == run.steps_per_epoch or progress.step - first == max_steps
        window += loss
        meters.update(loss, output, labels)
        bar.update()
        if prof is not None:
            prof.step()
        if progress.step % args.log_interval == 0 or progress.step == run.steps_per_epoch:
            t_log = log_train(run, progress, lr, window, t_log)
        if progress.step % args.metric_step == 0:
            log_train_metrics(run, progress, meters)
        if args.chkpt_every and progress.global_step % args.chkpt_every == 0:
            run.guard.check()  # every rank, before rank 0 saves: never checkpoint weights a NaN reached
            save(run, progress)
        failpoints.after_step(progress.global_step)  # the crash tests' faults; nothing when DLOJZ_FAULT is unset
        if run.stop.agreed():  # a step boundary: a consistent state to checkpoint
            stopped = True
            break
    stopped = run.stop.settle() or stopped  # a signal during the last step: stop at the end of the epoch
    bar.close()
    run.guard.check()
    run.chrono.finish()
    run.memory.end_training()  # before validation's shapes and cudnn trials raise the peak
    run.power.window_stop(run.chrono.images_after_warmup - images_before)
    progress.train = {'steps_run': progress.step - first, **meters.compute()}
    return stopped


@torch.inference_mode()
def evaluate(run, epoch, progress, max_batches=None, ema=False):
    """Exact validation: each rank evaluates its own unpadded shard of the validation set and the meters of
    all ranks are added up, so every image counts once whatever the world size. ema: the EMA weights."""
    starting.disarm()  # the run's work begins: from here a stop signal waits for a boundary
    model, chrono = run.ema.module if ema else run.eval_model, run.chrono
    model.eval()
    if run.args.nccl_debug:  # comm_profiler marker: the collectives that follow belong to validation
        print(f'Validation - rank {run.dist.rank}', flush=True)
    # rank 0's BatchNorm statistics, as in its checkpoint
    launch.broadcast_buffers_(run.ema.module if ema else run.model_without_ddp)
    meters, batches, raw_time = Meters(len(run.data.classes), run.device, criterion=True), 0, chrono.val_time
    most = shard.most_batches(run, max_batches)
    with run.memory.validation(), chrono.validation():  # the memory read after the Chronometer's sync
        for x, labels in itertools.islice(run.data.val_loader, max_batches):
            x, labels = to_device(x, labels, run)
            with run.autocast:
                output = model(x)  # loss: plain cross-entropy (timm's); criterion_loss: the training criterion's
                if output is not None:  # None: a pipeline stage before the last (counts no image)
                    meters.update(nn.functional.cross_entropy(output, labels), output, labels,
                                  run.criterion(output, labels))
            batches += 1
            failpoints.after_val_batch()
        # a sliced model gathers in every forward: every rank runs as many
        shard.blank_forwards(model, most - batches, run)
        # compute() is a collective; inside the timed block so that waiting for slower ranks counts
        res = dict(type='val_ema' if ema else 'val', epoch=epoch + 1, global_step=progress.global_step,
                   **meters.compute(), batches=batches, train_images=progress.images, wall_s=run_wall_s(run),
                   process_wall_s=process_wall_s(run))
    res['time_s'] = chrono.val_time
    if ema:  # the summary's validation time and batches stay the raw model's
        chrono.val_time = raw_time
    else:
        chrono.val_batches = batches
    run.log.log(**res)
    if not math.isfinite(res.get('loss', 0.0)):  # on every rank: the loss is the all-reduced one
        raise NonFiniteValidation(epoch + 1, progress.global_step)
    return res


# ------------------------------------------------------------------------------------------------ main

def main(args, dist=None, startup=None, hold_interrupt=False):
    """Validate the flags, join the process group, choose the run folder, then run (see _main).
    startup: the start-up's clock (cli's counts from the process's start; else from this call).
    hold_interrupt: see StopSignal.install (cli's process ends after an interrupt; a caller's goes on)."""
    dist = dist or get_dist_info()
    startup = startup or StartUp(time.time())
    with startup.phase('device'):
        device, raw, args, share, choice = _device(args, dist)
    with startup.phase('process_group'):
        launch.setup(dist, device, args.dist_timeout, share, alone=args.shard != 'none')
    with ExitStack() as taken:
        with startup.phase('run_folder'):
            taken.enter_context(rundir.taken(args, dist))  # sets args.output_dir on every rank
        if args.nccl_debug:  # before the first NCCL collective: the communicator's INIT lines go in
            os.makedirs(args.output_dir, exist_ok=True)  # node-local: each node's ranks make theirs
            tee = launch.StdoutTee(os.path.join(args.output_dir, f'nccl.rank{dist.rank}.log'))
            taken.callback(tee.close)  # before the run folder is released
            print(f'Train step 0 - rank {dist.rank}', flush=True)  # what follows is initialisation
        if args.tune_loader or args.tune:  # no StopSignal: the default actions
            starting.release()
        if args.loader_only or args.tune_loader:  # --loader-only: a stop ends it at once, recorded
            with stop_recorded(args, dist, 'loader'):
                return doctor.loader_mode(args, raw, dist, device)
        if args.tune:
            return tune.tune_mode(args, raw, dist, device, choice)
        return _main(args, dist, device, startup, hold_interrupt, choice)


def _device(args, dist):
    """-> (device, the flags as given, the flags checked, whether tasks share GPUs, the device's
    choices.Choices)"""
    if args.deterministic:  # cuBLAS reads it when its first handle is made: before any GPU matmul
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
    share = args.share_gpu or launch.mps_active()
    device = launch.pick_device(args.device, dist, share)
    raw = dict(vars(args))  # the flags as given: --tune-loader passes them on to its trials
    gpus = torch.cuda.device_count()
    backend = launch.process_group_backend(device.type, gpus, dist.local_world_size, share)
    choice = choices.of(device)  # DLOJZ_AS_IF_CUDA=1: a CPU run makes a CUDA run's choices
    args = flags.check_args(args, device, dist.world_size, job_id=dist.job_id, backend=backend,
                            choice=choice)
    threads = intra_op_threads(args.num_workers, device.type == 'cpu', dist.local_world_size)
    if threads:  # before the first parallel op: OpenMP sizes its pool then
        torch.set_num_threads(threads)
    if args.dist_debug:  # read by torch.distributed when the process group starts
        os.environ['TORCH_DISTRIBUTED_DEBUG'] = 'DETAIL'
    if args.nccl_debug:
        launch.nccl_debug_env()
    return device, raw, args, share, choice


def _main(args, dist, device, startup, hold_interrupt=False, choice=None):
    """Build the run, run its mode (train, LR sweep or evaluation), and end every way it can end with a
    summary.json that says how (errors), the power meter stopped and the logs closed."""
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.use_deterministic_algorithms(args.deterministic)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    seed_everything(args.seed)  # same seed on every rank: same initial weights, same augmentation streams
    run, progress = build_run(args, dist, device, Console(dist.is_main), startup, choice)
    with startup.phase('header'):
        print_header(run)
    power, extra, code = run.power, {}, 1
    # until the first step a stop ends the run (dist.starting)
    run.stop.install(EARLY_SIGNALS, hold_interrupt)
    try:
        # This attempt's record from its start: a kill or a full disk leaves 'running' with this attempt's config
        # and step, never an earlier attempt's summary (a 'preempted' one) that would read as the current state.
        # Rank 0 writes; a failure there (a full disk) stops every rank.
        with startup.phase('record'):
            config = os.path.join(args.output_dir, 'config.json')
            launch.on_ranks(lambda: (write_json(config, vars(args)),
                                     write_summary(run, progress, 'running')), when=dist.is_main)
        with startup.phase('meters'):
            run.chrono.start()
            power.start()
        if args.evaluate:  # an end-of-epoch checkpoint is the start of the next epoch
            epoch = progress.epoch - 1 if progress.step == 0 else progress.epoch
            progress.val = evaluate(run, max(0, epoch), progress, 20 if args.test else None)
            if run.ema is not None:
                progress.val_ema = evaluate(run, max(0, epoch), progress, 20 if args.test else None, ema=True)
        elif args.findlr:
            extra['findlr'] = recipe.find_lr(run, progress, train_step)
        else:
            # rank 0 only: one trace tells the story, and every rank's export would stall its own step
            run.chrono.labels = args.prof and dist.is_main
            if args.prof:  # the profiled steps, and the one that writes the trace, are slower; every rank waits
                # for rank 0's in the collectives, so every rank leaves the same steps out of its statistics
                run.chrono.exclude_steps = range(args.prof_wait, args.prof_wait + args.prof_warmup + args.prof_active)
            with profiler(device, os.path.join(args.output_dir, 'profiler'), args.prof_wait, args.prof_warmup,
                          args.prof_active) if run.chrono.labels else nullcontext() as prof:
                train(run, progress, prof)
        run.chrono.stop()
        power.stop()
        summary = write_summary(run, progress, 'completed', extra=extra)
        for line in final_lines(summary, run.chrono, run.steps_per_epoch):
            run.log.print(line)
        code = 0
        return summary
    except BaseException as e:
        starting.disarm()  # a stop during the record below is a flag: it must not lose the error
        if isinstance(e, starting.Stopped):  # before the first step: nothing to checkpoint
            e = starting.preempted(e, args, dist, launch.requeue, progress.global_step)
        err = translate(e, args, dist.rank, dist.distributed, progress.global_step + 1)
        if isinstance(err, Interrupted):  # Ctrl-C: where the run can continue from, as a preemption says
            err = interrupted(args, progress.global_step + 1)
        power.stop()  # not chrono.stop(): its GPU synchronise may raise again after a CUDA error
        status, msg = (err.status, str(err)) if err else ('crashed', f'{type(e).__name__}: {e}')
        try:
            write_summary(run, progress, status, msg,
                          extra=err.extra if err else {'failed_step': progress.global_step + 1})
        except DiskFull as full:  # summary.json keeps this attempt's 'running' record; a crash keeps its traceback
            if err is not None and not isinstance(err, DiskFull):
                err.args = (f'{err} (summary.json could not record it: {full})',)
        code = err.exit_code if err else 1
        if err is None:
            raise
        raise err from None
    finally:
        run.stop.restore()
        run.log.close(code)


def cli(argv=None):
    """python dlojz.py FLAGS -> exit code (errors lists them)."""
    dist, peer_failed, ended = None, False, False
    startup = StartUp(process_start_time(), imports_until=time.time())  # 1st phase: the imports
    try:
        args, dist = get_args_parser().parse_args(argv), get_dist_info()  # in this order: --help first
        starting.arm()  # from here to the first step, a stop signal ends the start-up
        main(args, dist, startup, hold_interrupt=True)
        ended = True
        return 0
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2, its sentence already printed)
        return e.code
    except DlojzError as e:  # Interrupted included (a KeyboardInterrupt too): before the next clause
        report_error(e, dist)
        peer_failed = isinstance(e, CommFailure)
        return e.exit_code
    except KeyboardInterrupt:  # before the run existed (afterwards _main turns it into Interrupted)
        e = Interrupted('interrupted')
        report_error(e, dist)
        return e.exit_code
    except starting.Stopped as e:  # before the run's record (afterwards _main writes it)
        e = starting.preempted(e, args, dist, launch.requeue)
        report_error(e, dist)
        return e.exit_code
    finally:
        starting.disarm()
        launch.cleanup(peer_failed, synchronize=ended)


if __name__ == '__main__':  # a caller of cli() (a test, a notebook) owns its collector
    freeze_imports()  # a full collection no longer scans what the imports made (0.16 s each)
    code = cli()
    if launch.abandoned:  # a dead peer's NCCL group: no teardown, no destructor that could wait for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
