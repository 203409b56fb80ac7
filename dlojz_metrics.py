"""What the training loop measures about learning, on the device and without a host sync per step:
loss and accuracy meters (shared by training and validation), the non-finite-loss guard, and the peak
memory a steady step needs."""
import torch

import dlojz_dist
from dlojz_errors import NonFiniteLoss
from dlojz_io import host_memory


class NonFiniteGuard:
    """Remembers on the device the first step whose loss was not finite; read every `every` steps (0: only
    when check() is called). Distributed, the read is a MIN all-reduce so that every rank stops at the same
    step (a rank stopping alone would leave the others waiting in the gradient all-reduce)."""
    GOOD = 2 ** 62  # "no bad step yet"

    def __init__(self, device, every, distributed=False):
        self.device, self.every, self.distributed = device, every, distributed
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

    def check(self):
        bad = dlojz_dist.all_reduce_(self.first_bad.clone(), 'min') if self.distributed else self.first_bad
        bad = int(bad.item())
        if bad < self.GOOD:
            raise NonFiniteLoss(bad + 1)


class Meters:
    """Per-image mean loss, top-1 and top-5 for training and validation, kept as four sums on the device
    (loss x images, top-1 hits, top-5 hits, images): an update is a few kernels with no host sync and no
    host-to-device copy. compute() reads the sums once; with sync (the default) the sums of every rank are
    added first, in one all-reduce, so every image counts once whatever the world size and whatever the size
    of each batch (a last batch of 10 weighs 10 images, not one batch). The contract is torchmetrics':
    update() is local, compute() is global; compute(sync=False) gives the rank's own values."""

    def __init__(self, num_classes, device):
        self.k = min(5, num_classes)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def update(self, loss, output, labels):
        """loss: the batch's mean loss (0-d tensor); output: (n, classes) logits; labels: (n,)."""
        n = labels.shape[0]
        hits = output.detach().topk(self.k, dim=1).indices == labels[:, None]  # (n, k): at most one True a row
        self.sums[0] += loss.detach().double() * n
        self.sums[1] += hits[:, 0].sum()
        self.sums[2] += hits.sum()
        self.sums[3] += n

    def compute(self, sync=True):
        """-> {'loss', 'top1', 'top5', 'images'}, or {} before any update (on every rank when synced)."""
        sums = dlojz_dist.all_reduce_(self.sums.clone()) if sync else self.sums
        loss, top1, top5, n = sums.tolist()
        if n == 0:
            return {}
        return {'loss': loss / n, 'top1': top1 / n, 'top5': top5 / n, 'images': int(n)}


class PeakMemory:
    """Peak memory of this process: the CUDA caching allocator's on a GPU, the resident set (VmHWM) on CPU.
    reset() once the warm-up steps are over, so that cudnn's benchmark trials, compilation and start-up do
    not count: the batch-size sweep reads what a steady step needs. `cuda` replaces torch.cuda in tests."""

    def __init__(self, device, cuda=torch.cuda, clear_refs='/proc/self/clear_refs'):
        self.device, self.gpu, self.cuda, self.clear_refs = device, device.type == 'cuda', cuda, clear_refs
        self.reset_done = False

    def reset(self):
        if self.gpu:
            self.cuda.reset_peak_memory_stats(self.device)
        else:
            try:  # Linux: '5' resets the peak resident set size of the process (proc(5), clear_refs)
                with open(self.clear_refs, 'w') as f:
                    f.write('5')
            except OSError:  # not Linux, or not allowed: the peak then includes the warm-up
                return
        self.reset_done = True

    def summary(self):
        """Bytes: {'host_peak_rss_bytes', 'host_rss_bytes', 'gpu_max_allocated_bytes', 'gpu_max_reserved_bytes',
        'peak_after_warmup'}."""
        return {**host_memory(),
                'gpu_max_allocated_bytes': self.cuda.max_memory_allocated(self.device) if self.gpu else None,
                'gpu_max_reserved_bytes': self.cuda.max_memory_reserved(self.device) if self.gpu else None,
                'peak_after_warmup': self.reset_done}

    def peak(self):
        """The figure the log line shows: GPU max allocated, or host peak RSS on CPU."""
        s = self.summary()
        return s['gpu_max_allocated_bytes'] if self.gpu else s['host_peak_rss_bytes']
