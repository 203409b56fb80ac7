"""What the training loop measures about learning, on the device and without a host sync per step:
loss and accuracy meters (shared by training and validation), the non-finite-loss guard, and the
peak memory a steady step needs."""
import time
from contextlib import contextmanager

import torch

from dlojzlib.dist import launch
from dlojzlib.errors import NonFiniteLoss
from dlojzlib.host import host_memory


class NonFiniteGuard:
    """Remembers on the device the first step whose loss was not finite; read every `every` steps
    (0: only when check() is called: on a GPU, by each log line, in the same read as its loss).
    Distributed, the read is a MIN all-reduce so that every rank stops at the same step (a rank
    stopping alone would leave the others waiting in the gradient all-reduce)."""
    GOOD = 2 ** 62  # "no bad step yet"

    def __init__(self, device, every, distributed=False, comm=None):
        self.device, self.every, self.distributed = device, every, distributed
        # its all-reduce is timed as the step's other collectives (measure.comm: a wait for a late
        # rank, on the CPU the first meeting after DDP's all-reduce)
        self.collective = comm.wait if comm is not None else lambda fn: fn()
        self.reset(0)

    def reset(self, global_step):
        self.first_bad = torch.full((), self.GOOD, dtype=torch.long, device=self.device)
        self.counter = torch.full((), global_step, dtype=torch.long, device=self.device)
        self.n = global_step

    def observe(self, loss):
        ok = torch.isfinite(loss.detach()) | (self.first_bad < self.GOOD)
        self.first_bad = torch.where(ok, self.first_bad, self.counter)
        self.counter += 1
        if self.every and self.n % self.every == 0:
            self.check()
        self.n += 1

    def check(self, *also):
        """Read the first bad step (a MIN all-reduce first when distributed) and raise if there is
        one, together with `also` (0-d tensors on the device) in the same read: the log line's loss
        comes with it, so the guard and the log line share one sync. -> the values of `also`."""
        bad = (self.collective(lambda: launch.all_reduce_(self.first_bad.clone(), 'min'))
               if self.distributed else self.first_bad)
        # float64 holds every step count exactly, and GOOD = 2**62 too
        values = torch.stack([bad.double(), *(t.detach().double() for t in also)]).tolist()
        if values[0] < self.GOOD:
            raise NonFiniteLoss(int(values[0]) + 1)
        return values[1:]


class Meters:
    """Per-image mean loss, top-1 and top-5 for training and validation, kept as four sums on the
    device (loss x images, top-1 hits, top-5 hits, images): an update is a few kernels with no host
    sync and no host-to-device copy. compute() reads the sums once; with sync (the default) the sums
    of every rank are added first, in one all-reduce, so every image counts once whatever the world
    size and whatever the size of each batch (a last batch of 10 weighs 10 images, not one batch).
    The contract is torchmetrics': update() is local, compute() is global; compute(sync=False) gives
    the rank's own values."""

    def __init__(self, num_classes, device, criterion=False):
        """criterion: also keep a second loss, update()'s criterion_loss (validation: the training
        criterion's)."""
        self.k, self.criterion = min(5, num_classes), criterion
        self.sums = torch.zeros(5 if criterion else 4, dtype=torch.float64, device=device)

    def update(self, loss, output, labels, criterion_loss=None):
        """loss: the batch's mean loss (0-d tensor); output: (n, classes) logits; labels: (n,).
        output None: a pipeline stage before the last, which has no logits and counts no image."""
        if output is None:
            return
        n = labels.shape[0]
        if self.criterion:
            self.sums[4] += criterion_loss.detach().double() * n
        # (n, k): at most one True a row
        hits = output.detach().topk(self.k, dim=1).indices == labels[:, None]
        self.sums[0] += loss.detach().double() * n
        self.sums[1] += hits[:, 0].sum()
        self.sums[2] += hits.sum()
        self.sums[3] += n

    def compute(self, sync=True):
        """-> {'loss', 'top1', 'top5', 'images'}, or {} before any update (on every rank when
        synced)."""
        sums = launch.all_reduce_(self.sums.clone()) if sync else self.sums
        loss, top1, top5, n, *criterion = sums.tolist()
        if n == 0:
            return {}
        return {'loss': loss / n, 'top1': top1 / n, 'top5': top5 / n, 'images': int(n),
                **({'criterion_loss': criterion[0] / n} if criterion else {})}


class PeakMemory:
    """Peak memory of this process: the CUDA caching allocator's on a GPU, the resident set (VmHWM)
    on CPU. reset() once the warm-up steps are over, so that cudnn's benchmark trials, compilation
    and start-up do not count: the batch-size sweep reads what a steady step needs. On a GPU,
    training's and validation's peaks are kept apart (validation has other shapes and cudnn tunes
    its own algorithms): end_training() at the end of an epoch's steps (their work completed),
    validation() around an evaluation. `cuda` replaces torch.cuda in tests."""

    def __init__(self, device, cuda=torch.cuda, clear_refs='/proc/self/clear_refs'):
        self.device, self.gpu, self.cuda = device, device.type == 'cuda', cuda
        self.clear_refs = clear_refs
        self.reset_done = False
        # (max allocated, max reserved) bytes over every epoch / validation
        self.train = self.val = None
        self._validating = False

    def reset(self):
        if self.gpu:
            self.cuda.reset_peak_memory_stats(self.device)
        else:
            # Linux: '5' resets the peak resident set size of the process (proc(5), clear_refs)
            try:
                with open(self.clear_refs, 'w') as f:
                    f.write('5')
            except OSError:  # not Linux, or not allowed: the peak then includes the warm-up
                return
        self.reset_done = True

    def _live(self):
        return (self.cuda.max_memory_allocated(self.device),
                self.cuda.max_memory_reserved(self.device))

    @staticmethod
    def _max(kept, live):
        return live if kept is None else tuple(map(max, kept, live))

    def end_training(self):
        """An epoch's training steps are over: keep their peak before a validation can raise it."""
        if self.gpu and not self._validating:
            self.train = self._max(self.train, self._live())

    @contextmanager
    def validation(self):
        """Around an evaluation whose work has completed at the end (the Chronometer synchronises):
        its own peak, then the counters reset so that the next epoch's training peak is training's
        alone."""
        if not self.gpu:
            yield
            return
        self.end_training()
        self.cuda.reset_peak_memory_stats(self.device)
        self._validating = True
        try:
            yield
            self.val = self._max(self.val, self._live())
        finally:
            self._validating = False
            self.cuda.reset_peak_memory_stats(self.device)

    def summary(self):
        """Bytes: {'host_peak_rss_bytes', 'host_rss_bytes', 'gpu_max_allocated_bytes',
        'gpu_max_reserved_bytes' (training's steps; an --evaluate run: its validation's),
        'val_gpu_max_allocated_bytes', 'val_gpu_max_reserved_bytes', 'peak_after_warmup'}."""
        train = val = (None, None)
        if self.gpu:
            val = self.val or (None, None)
            # training still under way (a summary after an error) counts its live peak
            train = self.train if self._validating else self._max(self.train, self._live())
            if self.train is None and self.val is not None and not self._validating:
                train = self.val  # no training step ran (--evaluate): the only peak there is
        return {**host_memory(),
                'gpu_max_allocated_bytes': train[0], 'gpu_max_reserved_bytes': train[1],
                'val_gpu_max_allocated_bytes': val[0], 'val_gpu_max_reserved_bytes': val[1],
                'peak_after_warmup': self.reset_done}

    def peak(self):
        """The figure the log line shows: GPU max allocated, or host peak RSS on CPU."""
        s = self.summary()
        return s['gpu_max_allocated_bytes'] if self.gpu else s['host_peak_rss_bytes']


def log_train(run, progress, lr, window, t_last):
    """The periodic training record; -> the time it was taken (wall time per step is measured
    between records, so it includes everything the loop does). `window`: this rank's loss summed
    since the record before. The record's loss is the mean over the data's replicas: every rank,
    or under a pipeline each replica's last stage, whose loss its stages' ranks all hold
    (Pipeline.share_loss): the sum over one stage's replicas (the mesh's 'dp' group) counts each
    once."""
    group = run.pipe.dp if run.pipe is not None else None

    def loss_sum():  # the loss's one all-reduce a record, then one read with the NaN guard's
        run.guard.collective(lambda: launch.all_reduce_(window, group=group))
        return run.guard.check(window)[0] / run.replicas

    now = train_record(run.log, run.chrono, run.memory, run.global_batch, lr, t_last, loss_sum,
                       epoch=progress.epoch + 1, step=progress.step,
                       global_step=progress.global_step)
    window.zero_()
    return now


def train_record(log, chrono, memory, global_batch, lr, t_last, loss_sum, **where):
    """Write the periodic 'train' record of the steps since t_last (dlojz.py's, and a Lightning
    run's: dlojzlib.lightning): their mean loss, step and data time, img/s and peak memory.
    loss_sum() reads the summed loss (the record's one host read), after the clocks are read.
    -> the time the record was taken."""
    data_s, n = chrono.interval()
    now = time.perf_counter()
    step_s = (now - t_last) / n
    mem = memory.peak()
    log.log(type='train', **where, loss=loss_sum() / n, lr=lr, step_ms=step_s * 1e3,
            data_ms=data_s * 1e3, img_s=global_batch / step_s if step_s else None,
            mem_bytes=mem)
    return now


def log_train_metrics(run, progress, meters):
    """Every rank: compute() adds up the meters of all ranks. With --metric-sync-log, each rank's
    own values before the sync are printed and recorded too (the course's metric_compute_log)."""
    before = meters.compute(sync=False) if run.args.metric_sync_log else None
    after = meters.compute()
    run.log.log(type='train_metrics', epoch=progress.epoch + 1, step=progress.step,
                global_step=progress.global_step, **after)
    if before is None:
        return
    name = f"{'GPU' if run.device.type == 'cuda' else 'CPU'}{run.dist.rank}"
    for when, v in (('Before', before), ('After', after)):
        if not v:  # a pipeline's earlier stage: it counts no image
            continue
        print(f"Step {progress.step} - {when} metric compute {name}: loss: {v['loss']:.4f}, "
              f"accuracy: {v['top1']:.4f}", flush=True)
    ranks = launch.all_gather_object({'rank': run.dist.rank, 'before': before, 'after': after})
    run.log.log(type='metric_sync', global_step=progress.global_step, step=progress.step,
                ranks=ranks)
