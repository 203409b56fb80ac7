"""What the training loop measures about learning, on the device and without a host sync per step:
loss and accuracy meters (torchmetrics, shared by training and validation) and the non-finite-loss guard."""
import torch
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

import dlojz_dist
from dlojz_errors import NonFiniteLoss


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
    """Mean loss, top-1 and top-5 on the device, for training and validation. compute() reads them; with
    sync (the default) on several ranks it is a collective: torchmetrics gathers every rank's state."""

    def __init__(self, num_classes, device, sync=True):
        acc = lambda k: MulticlassAccuracy(num_classes, top_k=k, average='micro', validate_args=False,
                                           sync_on_compute=sync).to(device)
        self.top1, self.top5 = acc(1), acc(min(5, num_classes))
        self.loss = MeanMetric(nan_strategy='disable', sync_on_compute=sync).to(device)

    def update(self, loss, output, labels, weight=1.0):
        self.loss.update(loss, weight=weight)
        self.top1.update(output, labels)
        self.top5.update(output, labels)

    def compute(self):
        if not self.loss.update_count:
            return {}
        return {'loss': self.loss.compute().item(), 'top1': self.top1.compute().item(),
                'top5': self.top5.compute().item()}
