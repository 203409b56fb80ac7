"""The built-in synthetic dataset: ImageNet-like JPEGs, generated once into --cache-dir
(data.datasets chooses it when no data folder is given).

ImageNet train images are mostly 500x375/375x500/500x333 JPEGs of ~110 KB at quality ~90. We draw a
1/f^beta luminance texture (the spectrum of natural scenes) tinted by a class hue, and paste a
class-shaped polygon (3..7 sides) in the complementary hue: colour and shape are learnable, texture
keeps the JPEG entropy, and so the decode cost, close to real photos."""
import colorsys
import io
import json
import math
import os
import shutil
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
from PIL import Image, ImageDraw

from dlojzlib import compat
from dlojzlib import failpoints
from dlojzlib.data.workers import ForkContext, ignore_preemption_signals
from dlojzlib.errors import DlojzError, OutOfMemory, writable

SYNTH_VERSION = 1  # bump when the generator changes so old caches are not reused

SHAPES = [(500, 375), (375, 500), (500, 333), (333, 500), (500, 500), (640, 480), (400, 400),
          (600, 450), (450, 600), (700, 467)]


def _texture(rng, h, w, beta):
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    amp = f ** (-beta)
    amp[0, 0] = 0.0
    phase = rng.uniform(0, 2 * np.pi, size=amp.shape)
    x = np.fft.irfft2(amp * np.exp(1j * phase), s=(h, w))
    return ((x - x.mean()) / (x.std() + 1e-8))[..., None]


def synthetic_image(seed, split, label, index, num_classes):
    """One deterministic ImageNet-like RGB image for (seed, split, class, index)."""
    rng = np.random.default_rng([seed, 0 if split == 'train' else 1, label, index])
    w, h = SHAPES[rng.integers(len(SHAPES))]
    scale = rng.uniform(0.85, 1.15)
    w, h = int(np.clip(w * scale, 300, 700)), int(np.clip(h * scale, 300, 700))
    hue = (label * 0.6180339887) % 1.0  # golden-ratio spacing keeps neighbouring classes apart
    bg = np.array(colorsys.hsv_to_rgb((hue + rng.normal(0, 0.02)) % 1.0, 0.55, 0.7)) * 255
    fg = np.array(colorsys.hsv_to_rgb((hue + 0.5) % 1.0, 0.8, 0.9)) * 255
    t = _texture(rng, h, w, 1.15)
    x = bg + rng.normal(0, 6, 3) + 36 * t * (0.8 + 0.4 * rng.random(3))
    r = rng.uniform(0.2, 0.35) * min(w, h)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    sides, rot = 3 + label % 5, rng.uniform(0, 2 * np.pi)
    angles = [rot + 2 * math.pi * k / sides for k in range(sides)]
    pts = [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in angles]
    mask = Image.new('L', (w, h), 0)
    ImageDraw.Draw(mask).polygon(pts, fill=255)
    m = np.asarray(mask, np.float32)[..., None] / 255.0
    x = x * (1 - m) + (fg + 30 * t[::-1, ::-1]) * m
    return Image.fromarray(np.clip(x, 0, 255).astype(np.uint8))


# Real ImageNet holds a few odd files; the synthetic train split reproduces them (class 0, first
# files) so the decoder is exercised on every run: grayscale, CMYK, a PNG named .JPEG, a progressive
# JPEG.
QUIRKS = {0: 'grayscale', 1: 'cmyk', 2: 'png', 3: 'progressive'}


def _write_one(job):
    failpoints.generator_image()
    seed, split, label, index, num_classes, path = job
    img = synthetic_image(seed, split, label, index, num_classes)
    quirk = QUIRKS.get(index) if (split == 'train' and label == 0) else None
    buf = io.BytesIO()
    if quirk == 'grayscale':
        img.convert('L').save(buf, 'JPEG', quality=90)
    elif quirk == 'cmyk':
        img.convert('CMYK').save(buf, 'JPEG', quality=90)
    elif quirk == 'png':
        img.save(buf, 'PNG')
    else:
        img.save(buf, 'JPEG', quality=90, progressive=(quirk == 'progressive'))
    with open(path, 'wb') as f:
        f.write(buf.getvalue())
    return len(buf.getvalue())


def pool_worker_signals():
    """A generator pool's worker: SIGTERM from the pool ends it; SIGTERM and SIGUSR2 from anyone
    else (Slurm signals every process of the step) do not, as for the loader's workers
    (data.workers)."""
    for s in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)  # not dlojz.py's early-signal recorder, inherited
    ignore_preemption_signals()


def ensure_synthetic_dataset(root, num_classes, train_per_class, val_per_class, seed, workers=None,
                             log=print):
    """Generate the synthetic dataset under root unless a complete copy is already there."""
    marker = os.path.join(root, 'COMPLETE.json')
    if os.path.exists(marker):
        return False
    writable(os.path.dirname(root), '--cache-dir', 'the synthetic dataset is generated there, '
             'once: pass --cache-dir with a writable folder')
    tmp = f'{root}.tmp-{os.getpid()}'
    jobs = []
    for split, per_class in (('train', train_per_class), ('val', val_per_class)):
        for label in range(num_classes):
            folder = os.path.join(tmp, split, f'n{label:08d}')
            os.makedirs(folder, exist_ok=True)
            jobs += [(seed, split, label, i, num_classes,
                      os.path.join(folder, f'{split}_{label:04d}_{i:05d}.JPEG'))
                     for i in range(per_class)]
    workers = workers or min(len(os.sched_getaffinity(0)), 8)
    log(f'Generating the synthetic dataset: {len(jobs)} JPEGs into {root} ({workers} processes)')
    if workers > 1:
        # The pool's workers outlive Slurm's SIGTERM to the process group (as the loader's do): one
        # killed by it lost its task and the pool waited for it forever; the main process stops at
        # its first step. They are forked as the loader's (data.workers.ForkContext), with the
        # signals blocked: a thread that a library starts in the child at fork (OpenBLAS's) would
        # otherwise take the signal first. ProcessPoolExecutor, not multiprocessing.Pool: a worker
        # that dies all the same (the OOM killer's SIGKILL) breaks the executor, which raises, where
        # Pool.map waited forever for the lost task.
        with ProcessPoolExecutor(workers, mp_context=ForkContext(),
                                 initializer=pool_worker_signals) as pool:
            # submits every chunk: the workers are forked
            results = pool.map(_write_one, jobs, chunksize=8)
            procs = compat.pool_processes(pool)
            try:
                sizes = list(results)
            except BrokenProcessPool:
                shutil.rmtree(tmp, ignore_errors=True)  # the next run generates it again
                for p in procs:  # reaped, so that each exit code says how it ended (else None)
                    p.join(timeout=10)
                died = sorted({-p.exitcode for p in procs if (p.exitcode or 0) < 0})
                why = ', '.join(signal.Signals(s).name for s in died) or 'an unknown cause'
                cls = OutOfMemory if signal.SIGKILL in died else DlojzError
                hint = '; most likely by the kernel\'s out-of-memory killer'
                oom = hint if cls is OutOfMemory else ''
                raise cls(f'a process generating the synthetic dataset into {root} was killed '
                          f'({why}{oom}); nothing was kept: run again on a node with free memory, '
                          f'or ask Slurm for more (--mem).') from None
    else:
        sizes = [_write_one(j) for j in jobs]
    with open(os.path.join(tmp, 'COMPLETE.json'), 'w') as f:
        json.dump({'version': SYNTH_VERSION, 'images': len(jobs),
                   'mean_bytes': float(np.mean(sizes))}, f)
    try:
        os.replace(tmp, root)  # atomic: a half-generated cache is never taken for a complete one
    except OSError:
        if not os.path.exists(marker):  # another process won the race; otherwise a real failure
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return True
