"""The loader benchmark of BENCHMARKS.md: an ImageNet-like corpus, and each pipeline pinned to one core.

    python dlojz_bench.py corpus /tmp/inet --images 1000            # ImageFolder, ImageNet's size distribution
    python dlojz_bench.py compare /tmp/inet --repeats 3 --cpu 0       # classic, dlojz fast, DALI CPU, per core

The corpus: real ILSVRC-2012 training files are a median 500 x 375 px, about 110 KB, 4 % grayscale, most of them
500 x 375, 375 x 500 or 500 x 333, with a few far larger. Its pictures are the synthetic dataset's 1/f texture
(data.datasets), with more amplitude and a flatter spectrum (beta 1.0) so that at quality 90 a 500 x 375 file
weighs about what an ImageNet one does, and so costs libjpeg-turbo about as much entropy decoding.

`compare` runs each pipeline as its own process under `taskset -c CPU` (one core for the loader's worker and
the main process together, as the issue's protocol), alternated `--repeats` times, and prints the medians:
- classic: torchvision's ImageFolder + PIL + RandomResizedCrop + flip + ToTensor + Normalize, one worker;
- fast: `dlojz.py --loader-only --decode fast --num-workers 1`;
- fast-whole: the same with region decoding turned off (DLOJZ_REGION_DECODE=0);
- fast-torch-handover: the same with torch's default collate (DLOJZ_HANDOVER=default);
- shards: the same from a `dlojz_data.py prepare --max-side 320` copy (made once, beside the corpus);
- dlojz-dali: `dlojz.py --loader-only --loader dali --num-workers 1` (DALI decodes dlojz's batches, one thread);
- dali: DALI's own CPU pipeline (file reader, fn.decoders.image_random_crop, resize, flip, normalise), one
  thread, when nvidia-dali is installed.
"""
import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np
from PIL import Image

from dlojzlib import ROOT, SCRIPT
from dlojzlib.flags import COUNT, POSITIVE_INT, SEED
from dlojzlib.record.rundir import run_record


# (width, height): weight. Medians: 500 x 375 by area; the small and large tails keep the mean area
# near ImageNet's (about 400 x 350 px on average, reported for the training set).
SIZES = {(500, 375): 40, (375, 500): 12, (500, 333): 15, (333, 500): 5, (500, 500): 6, (500, 400): 3,
         (400, 500): 3, (400, 300): 4, (300, 225): 3, (350, 263): 3, (640, 480): 3, (800, 600): 1.5,
         (1024, 768): 1, (1200, 900): 0.5}
GRAYSCALE = 0.04


def corpus_image(seed, index):
    """-> (PIL image, is_grayscale) for one file of the corpus."""
    from dlojzlib.data import datasets
    rng = np.random.default_rng([seed, index])
    sizes, weights = list(SIZES), np.array(list(SIZES.values()), float)
    w, h = sizes[rng.choice(len(sizes), p=weights / weights.sum())]
    base = rng.uniform(60, 190, 3)
    t = datasets._texture(rng, h, w, 1.0)
    x = base + 50 * t * (0.8 + 0.4 * rng.random(3))
    img = Image.fromarray(np.clip(x, 0, 255).astype(np.uint8))
    gray = rng.random() < GRAYSCALE
    return (img.convert('L') if gray else img), gray


def make_corpus(root, images=1000, classes=10, val_per_class=4, seed=0, log=print):
    """Write root/train/<class>/*.JPEG (`images` files) and a small val/ (the loader needs one) -> stats."""
    sizes, areas, gray = [], [], 0
    for split, n in (('train', images), ('val', classes * val_per_class)):
        for i in range(n):
            img, g = corpus_image(seed + (0 if split == 'train' else 1), i)
            folder = os.path.join(root, split, f'n{i % classes:08d}')
            os.makedirs(folder, exist_ok=True)
            buf = io.BytesIO()
            img.save(buf, 'JPEG', quality=90)
            with open(os.path.join(folder, f'{split}_{i:06d}.JPEG'), 'wb') as f:
                f.write(buf.getvalue())
            if split == 'train':
                sizes.append(len(buf.getvalue()))
                areas.append(img.width * img.height)
                gray += g
    stats = {'images': images, 'median_bytes': int(statistics.median(sizes)),
             'mean_bytes': int(statistics.mean(sizes)), 'median_pixels': int(statistics.median(areas)),
             'mean_pixels': int(statistics.mean(areas)), 'grayscale': gray}
    with open(os.path.join(root, 'corpus.json'), 'w') as f:
        json.dump(stats, f, indent=1)
    log(f'corpus: {json.dumps(stats)}')
    return stats


# ------------------------------------------------------------------------------------------ one pipeline

def classic(root, size, batch, steps, warmup):
    """The classic torchvision pipeline, one worker -> img/s over `steps` batches after `warmup`."""
    import torch
    import torchvision
    from torchvision import transforms as T
    torch.set_num_threads(1)
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds = torchvision.datasets.ImageFolder(os.path.join(root, 'train'), tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=1, persistent_workers=True)
    return _rate((b for _ in iter(int, 1) for b in dl), steps, warmup)  # epoch after epoch


def dali_pipeline(root, size, batch, steps, warmup):
    """DALI's CPU pipeline, one thread: the crop decoded alone (image_random_crop, same area and ratio ranges as
    RandomResizedCrop), resize, flip, normalise to float CHW -> img/s."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=os.path.join(root, 'train'), random_shuffle=True, name='r')
        images = fn.decoders.image_random_crop(jpegs, device='cpu', output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout='CHW',
                                          mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                          std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
                                          mirror=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ['x', 'y'], reader_name='r')
    return _rate(_endless(it), steps, warmup)


def _endless(it):
    while True:
        for out in it:
            yield out[0]['x'], out[0]['y']
        it.reset()


def _rate(batches, steps, warmup):
    it = iter(batches)
    for _ in range(warmup):
        next(it)
    t0, n = time.perf_counter(), 0
    for _ in range(steps):
        n += len(next(it)[1])
    return n / (time.perf_counter() - t0)


def dlojz(root, size, batch, steps, warmup, extra=(), env=None):
    """dlojz.py --loader-only, one worker -> the img/s it prints."""
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, SCRIPT, '--loader-only', '--data-dir', root,
               '--num-workers', '1', '-b', str(batch), '--image-size', str(size), '--test-nsteps', str(steps),
               '--warmup-steps', str(warmup), '--wandb', 'off', '--output-dir', out, '--overwrite', *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        return run_record(out)['loader']['images_per_second']


def one(name, root, size, batch, steps, warmup):
    if name == 'classic':
        return classic(root, size, batch, steps, warmup)
    if name == 'dali':
        return dali_pipeline(root, size, batch, steps, warmup)
    if name == 'fast':
        return dlojz(root, size, batch, steps, warmup)
    if name == 'fast-whole':  # the whole file decoded, DCT-scaled (no region decoding)
        return dlojz(root, size, batch, steps, warmup, env={'DLOJZ_REGION_DECODE': '0'})
    if name == 'fast-torch-handover':  # torch's default collate: a new shared block per batch
        return dlojz(root, size, batch, steps, warmup, env={'DLOJZ_HANDOVER': 'default'})
    if name == 'dlojz-dali':  # --loader dali: DALI decodes dlojz's own batches and boxes, one thread
        return dlojz(root, size, batch, steps, warmup, ['--loader', 'dali'])
    if name == 'shards':
        return dlojz(root, size, batch, steps, warmup, ['--data-dir', shards_of(root)])
    raise SystemExit(f'unknown pipeline {name}')


def shards_of(root):
    """The --max-side 320 shards of root, prepared once beside it."""
    dst = root.rstrip('/') + '-shards320'
    if not os.path.exists(os.path.join(dst, 'index.json')):
        subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_data.py'), 'prepare', root, dst, '--max-side', '320'],
                       check=True, stdout=subprocess.DEVNULL)
    return dst


def compare(root, pipelines, repeats, cpu, size, batch, steps, warmup):
    """Each pipeline in its own process pinned to `cpu`, alternated -> {name: [img/s]}."""
    if 'shards' in pipelines:
        shards_of(root)
    results = {p: [] for p in pipelines}
    for r in range(repeats):
        for p in pipelines:
            cmd = ['taskset', '-c', str(cpu), sys.executable, os.path.join(ROOT, 'dlojz_bench.py'), 'one', p, root,
                   '--image-size', str(size), '-b', str(batch), '--steps', str(steps), '--warmup', str(warmup)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[p].append(float(re.findall(r'RATE ([\d.]+)', out)[-1]))
            print(f'round {r + 1} {p}: {results[p][-1]:.1f} img/s', flush=True)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest='cmd', required=True)
    c = sub.add_parser('corpus', help='write an ImageNet-like ImageFolder')
    c.add_argument('root')
    c.add_argument('--images', type=POSITIVE_INT, default=1000)
    c.add_argument('--seed', type=SEED, default=0)
    for name in ('compare', 'one'):
        q = sub.add_parser(name)
        if name == 'one':
            q.add_argument('pipeline')
        q.add_argument('root')
        q.add_argument('--image-size', type=POSITIVE_INT, default=224)
        q.add_argument('-b', '--batch-size', type=POSITIVE_INT, default=32)
        q.add_argument('--steps', type=POSITIVE_INT, default=60,
                       help='batches measured (after --warmup)')
        q.add_argument('--warmup', type=COUNT, default=3)
        if name == 'compare':
            q.add_argument('--repeats', type=POSITIVE_INT, default=3)
            q.add_argument('--cpu', type=COUNT, default=0,
                           help='the core every pipeline is pinned to')
            q.add_argument('--pipelines', default=None, help='comma-separated; default classic,fast,shards[,dali]')
    a = p.parse_args(argv)
    if a.cmd == 'compare' and a.cpu not in os.sched_getaffinity(0):
        p.error(f'--cpu {a.cpu} is not a core this process may run on; choose one of '
                f'{", ".join(map(str, sorted(os.sched_getaffinity(0))))}.')
    known = ('classic', 'fast', 'shards', 'dali', 'fast-whole', 'fast-torch-handover', 'dlojz-dali')
    unknown = [n for n in (a.pipelines.split(',') if getattr(a, 'pipelines', None) else [])
               + ([a.pipeline] if a.cmd == 'one' else []) if n not in known]
    if unknown:
        p.error(f'unknown pipeline {unknown[0]!r}; choose among {", ".join(known)}.')
    from dlojzlib.data import dali  # is DALI installed (one import of torch, in the parent only)
    if a.cmd == 'corpus':
        make_corpus(a.root, a.images, seed=a.seed)
    elif a.cmd == 'one':
        print(f'RATE {one(a.pipeline, a.root, a.image_size, a.batch_size, a.steps, a.warmup):.3f}')
    else:
        names = a.pipelines.split(',') if a.pipelines else ['classic', 'fast', 'shards'] + (['dali'] * (dali.dali() is not None))
        res = compare(a.root, names, a.repeats, a.cpu, a.image_size, a.batch_size, a.steps, a.warmup)
        base = statistics.median(res['classic']) if 'classic' in res else None
        print('| pipeline | ' + ' | '.join(f'run {i + 1}' for i in range(a.repeats)) + ' | median | x classic |')
        print('|---' * (a.repeats + 3) + '|')
        for name, v in res.items():
            m = statistics.median(v)
            ratio = f'{m / base:.2f}' if base else '-'
            print(f'| {name} | ' + ' | '.join(f'{x:.0f}' for x in v) + f' | {m:.0f} | {ratio} |')


if __name__ == '__main__':
    main()
