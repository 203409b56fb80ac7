"""dlojz's Chronometer as a Lightning Callback: the same step records, '>>>' lines, summary.json and
metrics.jsonl as dlojz.py, for any LightningModule, from Lightning's public hooks.

    trainer = pl.Trainer(callbacks=[Chronometer(output_dir='runs/rn50')])

A Lightning step, as the hooks see it (docs/lightning.md):
- it runs from the end of the step before (on_train_batch_end; the epoch's start or a validation's
  end for the first) to its own end, so that the steps tile the training's wall time as dlojz.py's
  do; Lightning's bookkeeping between two steps falls in the step that follows;
- data: with ImageFolderDataModule, its loader's own wait, which the DataModule stamps; with any
  other data, everything from the step's start to on_train_batch_start: the fetch, Lightning's copy
  to the device and its bookkeeping. summary.json['lightning']['data_wait'] says which;
- h2d: the DataModule's copy and normalisation; with other data the copy is not seen apart (it runs
  before on_train_batch_start, outside the step's device span);
- forward: on_train_batch_start to on_before_backward (training_step, the loss, zero_grad);
- backward: on_before_backward to on_after_backward;
- optimizer: on_before_optimizer_step to on_train_batch_end (the update, the LR schedulers);
- under DDP, the gradient all-reduce through a communication hook (measure.comm), as dlojz.py's.
On a GPU the phases are CUDA events read once they have completed: the callback adds no host
synchronisation to a step. The time spent in its own hooks is measured and reported (its
overhead)."""
import datetime
import functools
import math
import os
import time

import lightning.pytorch as pl
import torch

import dlojz_chrono
from dlojzlib.dist import launch
from dlojzlib.host import host_check, provenance
from dlojzlib.lightning.datamodule import ImageFolderDataModule, dist_of
from dlojzlib.measure.comm import CommTimer
from dlojzlib.measure.power import PowerMeter
from dlojzlib.metrics import PeakMemory, train_record
from dlojzlib.record.log import SUMMARY_VERSION, Console, Logger, write_json
from dlojzlib.record.summary import (communication_estimate, energy_over_ranks, final_lines,
                                     rank_timing, ranks_summary)

SIGTERM_SYNC = ('Lightning broadcasts its SIGTERM flag from rank 0 and reads it on the host at '
                'each step under DDP (a host-device synchronisation per step, in the host share)')
OTHER_DATA = ('the data wait is the time from the step\'s start to on_train_batch_start: the '
              'fetch, Lightning\'s copy to the device and its bookkeeping (ImageFolderDataModule '
              'times the loader\'s wait and the copy apart)')
NOT_SPLIT = ('the start-up (imports, the Trainer, the process group, the model) is not split into '
             'phases, and the model states per rank are not measured')


def _counted(hook):
    """A per-step hook whose own time adds up to the callback's overhead (seconds)."""
    @functools.wraps(hook)
    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self.hooks_s += time.perf_counter() - t
    return timed


class Chronometer(pl.Callback):
    """output_dir: where summary.json, config.json and metrics.jsonl go (default
    runs/lightning_<job id or time>_<module>); warmup_steps: steps left out of the statistics, as
    dlojz.py's --warmup-steps; phases: time the phases (--timing); sync_timing: synchronise around
    each phase instead of CUDA events (--sync-timing)."""

    def __init__(self, output_dir=None, warmup_steps=1, phases=True, sync_timing=False):
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f'warmup_steps must be 0 or more, not {warmup_steps}')
        self.output_dir, self.warmup, self.phases, self.sync = output_dir, warmup_steps, phases, \
            sync_timing
        self.chrono = self.dist = self.log = None
        self.hooks_s = 0.0
        self.unseen = []     # what the hooks cannot see, named in the record
        self._open = []      # the phases entered and not yet left: [(name, context)]
        self._t_last = None  # host time the next step starts from
        self._window = None  # this rank's loss summed on the device since the last record
        self._val = None
        self._ended = False
        self._batches = 0    # training batches seen: a train record every log_every_n_steps
        self.host = None

    # ------------------------------------------------------------------------- set-up and records
    def setup(self, trainer, pl_module, stage):
        if stage != 'fit' or self.chrono is not None:
            return
        device = trainer.strategy.root_device
        self.dist = dist_of(trainer)
        self.chrono = dlojz_chrono.Chronometer(device, phases=self.phases, sync=self.sync,
                                               warmup=self.warmup)
        self.memory = PeakMemory(device)
        self.power = PowerMeter(device, gather=launch.all_gather_object)
        self.chrono.on_steady += [self.memory.reset, self.power.window_start]
        stamp = self.dist.job_id or datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
        name = f'lightning_{stamp}_{type(pl_module).__name__}'
        path = self.output_dir or os.path.join('runs', name)
        self.output_dir = trainer.strategy.broadcast(os.path.abspath(path))  # rank 0's
        if trainer.is_global_zero:
            os.makedirs(self.output_dir, exist_ok=True)
        self.log = Logger(os.path.join(self.output_dir, 'metrics.jsonl'),
                          Console(trainer.is_global_zero))
        self.ours = isinstance(trainer.datamodule, ImageFolderDataModule)
        if self.ours:  # its loader stamps each wait, its copy is a phase
            trainer.datamodule.timer = self
        else:
            self.unseen.append(OTHER_DATA)
        if trainer.world_size > 1:
            self.unseen.append(SIGTERM_SYNC)
        self.unseen.append(NOT_SPLIT)

    def on_fit_start(self, trainer, pl_module):
        ddp = trainer.strategy.model
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            self.attach_comm(ddp, trainer.world_size, trainer.strategy.root_device)
        workers = trainer.datamodule.args.num_workers if self.ours else 0
        self.host = host_check(workers, not self.chrono.cuda)
        if trainer.is_global_zero:
            write_json(os.path.join(self.output_dir, 'config.json'),
                       self.config(trainer, pl_module))
        self.write(trainer, pl_module, 'running')
        self.chrono.start()
        self.power.start()

    def attach_comm(self, ddp, world_size, device):
        """The gradient all-reduce, timed as dlojz.py times it (measure.comm), unless the module
        has a communication hook of its own (DDP takes one)."""
        timeline = dlojz_chrono.CudaTimeline(device) if self.chrono.cuda else None
        comm = CommTimer(world_size, timeline)
        try:
            ddp.register_comm_hook(None, comm.hook)
        except RuntimeError:
            self.unseen.append('the gradient all-reduce: the DDP strategy has a communication hook '
                               'of its own, so its exposed part is not timed')
            return
        if getattr(ddp, 'broadcast_buffers', False):
            comm.time_buffers(ddp)
        self.chrono.comm = comm
        self.bucket_cap_mb = ddp.bucket_bytes_cap / 2**20

    def config(self, trainer, pl_module):
        """config.json: what the record can say of the run's settings."""
        dm = trainer.datamodule
        return {'program': 'lightning', 'lightning': pl.__version__,
                'module': type(pl_module).__name__,
                'arch': getattr(pl_module, 'arch', type(pl_module).__name__),
                'batch_size': getattr(dm, 'batch_size', None) if dm is not None else None,
                'datamodule': type(dm).__name__ if dm is not None else None,
                'data_flags': vars(dm.args) if self.ours else None,
                'strategy': type(trainer.strategy).__name__, 'precision': trainer.precision,
                'accelerator': type(trainer.accelerator).__name__, 'devices': trainer.num_devices,
                'num_nodes': trainer.num_nodes, 'max_epochs': trainer.max_epochs,
                'max_steps': trainer.max_steps,
                'accumulate_grad_batches': trainer.accumulate_grad_batches,
                'warmup_steps': self.warmup, 'timing': self.phases, 'sync_timing': self.sync,
                'output_dir': self.output_dir}

    # ------------------------------------------------------------------------------ the steps
    def on_train_epoch_start(self, trainer, pl_module):
        self.chrono.steady_check()
        if len(self.chrono.steps) >= self.warmup:  # a later epoch: its steps count for J/image
            self.power.window_start()
        self._images_before = self.chrono.images_after_warmup
        self._t_last = time.perf_counter()
        self._t_log = self._t_last
        if self._window is None:
            self._window = torch.zeros((), device=pl_module.device)

    def batch_arrived(self, batch, wait):
        """ImageFolderDataModule's call, before it copies a training batch: the step begins with
        the loader's own wait."""
        self.chrono.begin_step(batch, self._t_last, wait)

    def phase(self, name):
        return self.chrono.phase(name)

    def _enter(self, name):
        context = self.chrono.phase(name)
        context.__enter__()
        self._open.append((name, context))

    def _leave(self, name=None):
        while self._open:
            was, context = self._open.pop()
            context.__exit__(None, None, None)
            if was == name:
                return

    @_counted
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.chrono.in_step:  # any other data: the wait is everything up to this hook
            now = time.perf_counter()
            self.chrono.begin_step(batch, self._t_last, now - self._t_last)
        self._enter('forward')

    @_counted
    def on_before_backward(self, trainer, pl_module, loss):
        if self.chrono.in_step:
            self._leave('forward')
            self._enter('backward')

    @_counted
    def on_after_backward(self, trainer, pl_module):
        self._leave('backward')

    @_counted
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.chrono.in_step:
            self._leave()
            self._enter('optimizer')

    @_counted
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._leave()
        if not self.chrono.in_step:
            return
        loss = outputs.get('loss') if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._window += loss.detach().float()
        self._batches += 1
        every = trainer.log_every_n_steps  # 0: no periodic record
        if every and self._batches % every == 0:  # inside the step, as dlojz.py's: its all-reduce
            self.log_train(trainer)  # is a wait of this step's (measure.comm)
        self.chrono.end_step()
        self.chrono.steady_check()
        self._t_last = time.perf_counter()

    def log_train(self, trainer):
        """dlojz.py's periodic record (metrics.train_record). Its loss, as dlojz.py's: the mean
        over the ranks of each one's loss since the record before (what Lightning's
        self.log(..., sync_dist=True) would give each step; without sync_dist its loggers write
        rank 0's), in one all-reduce and one read a record. Every rank comes here at the same
        step (every log_every_n_steps batches)."""
        lr = trainer.optimizers[0].param_groups[0]['lr'] if trainer.optimizers else None

        def loss_sum():  # timed as the step's other collectives: a wait for a late rank
            comm = self.chrono.comm
            reduce = lambda: launch.all_reduce_(self._window)  # noqa: E731
            return (comm.wait(reduce) if comm is not None else reduce()).item() / trainer.world_size

        self._t_log = train_record(self.log, self.chrono, self.memory,
                                   (self.chrono.full_batch or 0) * trainer.world_size, lr,
                                   self._t_log, loss_sum,
                                   epoch=trainer.current_epoch + 1, step=trainer.global_step,
                                   global_step=trainer.global_step)
        self._window.zero_()

    def on_train_epoch_end(self, trainer, pl_module):
        self.chrono.finish()
        self.memory.end_training()
        self.power.window_stop(self.chrono.images_after_warmup - self._images_before)

    # ------------------------------------------------------------------------------ validation
    def on_validation_start(self, trainer, pl_module):
        if trainer.sanity_checking or self.chrono is None:
            return
        self._val = [self.memory.validation(), self.chrono.validation()]
        for context in self._val:
            context.__enter__()
        self._val_batches = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                dataloader_idx=0):
        if self._val is not None:
            self._val_batches += 1

    def on_validation_end(self, trainer, pl_module):
        if self._val is None:
            return
        for context in reversed(self._val):
            context.__exit__(None, None, None)
        self._val = None
        self.chrono.val_batches = self._val_batches
        # the module's validation metrics, as logged ('val_loss' is recorded as 'loss')
        metrics = {k.split('val_', 1)[-1].split('val/', 1)[-1]: float(v)
                   for k, v in trainer.callback_metrics.items()
                   if k.startswith(('val_', 'val/')) and getattr(v, 'numel', lambda: 1)() == 1}
        self.log.log(type='val', epoch=trainer.current_epoch + 1, global_step=trainer.global_step,
                     **metrics, batches=self._val_batches, time_s=self.chrono.val_time)
        self._t_last = time.perf_counter()  # the validation is no step's

    # ------------------------------------------------------------------------------ the end
    def on_train_end(self, trainer, pl_module):
        self.chrono.stop()
        self.power.stop()
        summary = self.write(trainer, pl_module, 'completed', gather=True)
        self._ended = True
        if trainer.is_global_zero:
            for line in final_lines(summary, self.chrono, self.steps_per_epoch(trainer)):
                print(line, flush=True)

    def on_exception(self, trainer, pl_module, exception):
        if self.chrono is None or self._ended:
            return
        from lightning.pytorch.utilities.exceptions import SIGTERMException
        status = 'interrupted' if isinstance(exception, KeyboardInterrupt) else \
            'preempted' if isinstance(exception, SIGTERMException) else 'crashed'
        self.power.stop()
        self.write(trainer, pl_module, status, f'{type(exception).__name__}: {exception}')

    def teardown(self, trainer, pl_module, stage):
        if self.log is not None and stage == 'fit':
            self.log.close(0 if self._ended else 1)

    @staticmethod
    def steps_per_epoch(trainer):
        n = trainer.num_training_batches
        return int(n) if isinstance(n, (int, float)) and math.isfinite(n) else None

    def write(self, trainer, pl_module, status, error=None, gather=False):
        """summary.json, dlojz.py's shape (record.summary.write_summary): every rank calls it on a
        completed run (the ranks' reports are gathered), rank 0 writes it."""
        chrono, ws = self.chrono, trainer.world_size
        steps_per_epoch = self.steps_per_epoch(trainer)
        global_batch = (chrono.full_batch or 0) * ws  # images per Lightning step, every rank's
        val_total = sum(trainer.num_val_batches) if trainer.num_val_batches else None
        timing = chrono.summary(global_batch, steps_per_epoch,
                                val_total if isinstance(val_total, int) else None)
        walls = sum(r['step'] for r in chrono.steps)
        dm = trainer.datamodule
        summary = {
            'version': SUMMARY_VERSION, 'status': status, 'error': error,
            'config': self.config(trainer, pl_module),
            'provenance': provenance(trainer.strategy.root_device, self.dist),
            'world_size': ws, 'num_nodes': trainer.num_nodes, 'global_batch': global_batch,
            'mode': 'train',
            'data': dm.data.record(steps_per_epoch) if self.ours else
            {'source': type(dm).__name__ if dm else None, 'batches_per_epoch': steps_per_epoch},
            'timing': timing, 'memory': self.memory.summary(), 'host': self.host,
            'energy': self.power.summary(), 'global_step': trainer.global_step,
            'lightning': {'version': pl.__version__,
                          'data_wait': 'loader' if self.ours else 'between steps',
                          'unseen': self.unseen, 'callback_s': self.hooks_s,
                          'callback_share': self.hooks_s / walls if walls else None},
        }
        if chrono.comm is not None:
            summary['communication'] = communication_estimate(self.bucket_cap_mb, pl_module,
                                                              'none', ws)
        if gather and ws > 1:
            ranks = launch.all_gather_object(rank_timing(chrono, self.memory, self.power,
                                                         trainer.global_rank))
            for r in ranks:  # the entries dlojz.py's rank reports have too, unmeasured here
                r.update(pipe_rank=None, model_states=None, startup=None)
            timing['bound_rank0'] = timing.get('bound')
            timing.update(ranks_summary(ranks))
            summary['energy'].update(energy_over_ranks(ranks))
        if trainer.is_global_zero:
            write_json(os.path.join(self.output_dir, 'summary.json'), summary)
        return summary
