"""Augmentations beyond RandomResizedCrop + flip: in the workers, RandAugment / TrivialAugmentWide /
random erasing (torchvision's v2 transforms on uint8 tensors); on the device, mixup and cutmix with
soft targets; and progressive resizing (the training resolution grows over the epochs, FFCV style).

Determinism: the worker-side transforms draw from torch's generator, seeded for each sample from the
sample's own RNG (seed, epoch, index) after the crop and flip draws, so a batch is the same whatever
the number of workers and a resumed run sees the same images. Mixup and cutmix draw their mixing
weight and box on the host from a generator seeded by (seed, optimizer step, virtual rank): no
host-device synchronisation, the same draws after a resume, and one process accumulating N
micro-batches draws what N ranks would."""
import math

import torch
from torchvision.transforms import v2

from dlojzlib import compat
from dlojzlib.flags import parse_randaugment


def worker_ops(args):
    """The worker-side augmentations the flags ask for, as one v2 transform on uint8 CHW tensors, or
    None."""
    ops = []
    if args.randaugment:
        n, m = parse_randaugment(args.randaugment)
        ops.append(v2.RandAugment(num_ops=n, magnitude=m))
    if args.trivialaugment:
        ops.append(v2.TrivialAugmentWide())
    if args.random_erasing:
        ops.append(v2.RandomErasing(p=args.random_erasing, value=0))
    return v2.Compose(ops) if ops else None


class Augmented:
    """A training transform followed by worker-side augmentations, seeded per sample: the draws come
    after the crop's and flip's, so those stay the same with or without augmentation."""

    def __init__(self, transform, ops):
        self.transform, self.ops = transform, ops
        self.decode = transform.decode

    @property
    def size(self):
        return self.transform.size

    @size.setter
    def size(self, value):  # progressive resizing sets the resolution of the epoch
        self.transform.size = value

    def __call__(self, src, rng):
        x = self.transform(src, rng)
        seed = rng.getrandbits(63)
        with torch.random.fork_rng(devices=[]):  # the worker's own torch RNG stream is left as it was
            torch.manual_seed(seed)
            return self.ops(x)


def resolution(epoch, start, end, ramp_end, multiple=8):
    """Progressive resizing: `start` pixels at epoch 0, growing linearly to `end` at epoch
    `ramp_end` and `end` after, rounded down to a multiple of `multiple` (FFCV rounds to 32 at
    ImageNet sizes)."""
    if ramp_end <= 0 or epoch >= ramp_end:
        return end
    res = start + (end - start) * epoch / ramp_end
    return max(multiple, int(res) // multiple * multiple)


class Mix:
    """Mixup (Zhang et al. 2018) and cutmix (Yun et al. 2019) on the device, one of the two per
    batch (an even draw when both are on, as timm does). -> (mixed images, soft targets). The weight
    lambda and the box are drawn on the host from a generator seeded by (seed, step, rank): no sync,
    no state to save; each image's partner is the next one of the batch (a roll by one, as
    torchvision's v2 MixUp; the batch is already shuffled); cutmix's lambda is corrected to the
    box's true area after clipping."""

    def __init__(self, mixup, cutmix, num_classes, seed=0):
        self.mixup, self.cutmix, self.num_classes, self.seed = mixup, cutmix, num_classes, seed
        self.gen = torch.Generator()

    def draw(self, alpha):
        """Beta(alpha, alpha), as a ratio of two Gamma(alpha) draws from our generator (torch's Beta
        takes none)."""
        a, b = compat.standard_gamma(torch.full((2,), float(alpha)), self.gen).tolist()
        return a / (a + b)

    def __call__(self, x, y, step=0, rank=0):
        """step: the optimizer step; rank: the virtual rank (rank x --accum-steps + micro-batch)."""
        if not (self.mixup or self.cutmix):
            return x, y
        self.gen.manual_seed(((self.seed * 1_000_003 + step) * 1_000_003 + rank) % 2 ** 63)
        use_cutmix = self.cutmix > 0 and (self.mixup == 0 or float(torch.rand((), generator=self.gen)) < 0.5)
        partner_x, partner_y = x.roll(1, 0), y.roll(1, 0)
        if use_cutmix:
            lam = self.draw(self.cutmix)
            h, w = x.shape[-2:]
            cut = math.sqrt(1 - lam)
            ch, cw = int(h * cut), int(w * cut)
            cy, cx = int(torch.randint(0, h, (), generator=self.gen)), int(torch.randint(0, w, (), generator=self.gen))
            y0, y1 = max(0, cy - ch // 2), min(h, cy + ch // 2)
            x0, x1 = max(0, cx - cw // 2), min(w, cx + cw // 2)
            x = x.clone()
            x[..., y0:y1, x0:x1] = partner_x[..., y0:y1, x0:x1]
            lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)
        else:
            lam = self.draw(self.mixup)
            x = x * lam + partner_x * (1 - lam)
        one_hot = torch.nn.functional.one_hot(y, self.num_classes).to(x.dtype)
        partner = torch.nn.functional.one_hot(partner_y, self.num_classes).to(x.dtype)
        return x, one_hot * lam + partner * (1 - lam)
