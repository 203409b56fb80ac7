"""--loader dali: NVIDIA DALI decodes, crops, resizes and flips; dlojz says which images, in which
order, and where each crop is.

Only the pixels go through DALI. The batches come from the same samplers as the native loader's
(StepBatchSampler for training: the per-rank shares, the epoch's shuffle, a resumed epoch's
remaining steps; ShardSampler for validation: each image once at any world size). Each training
sample's RandomResizedCrop box and flip are drawn from the same per-sample RNG as --decode fast's
(seed, epoch, index), from the file header's size. The native loader and DALI therefore crop the
same boxes and differ only by decoder and resampler. fn.decoders.image_slice decodes the box alone
(libjpeg-turbo's region decoding on CPU; on a GPU the 'mixed' decoder, nvJPEG with the A100/H100
hardware JPEG engine). fn.resize (bilinear, antialiased, as torchvision's) and the flip then give
uint8 CHW batches. The training loop normalises them on the device, as it does the native loader's.

On CPU, DALI's thread pool has --num-workers threads (at least one). On a GPU the pipeline runs on
this rank's device. One batch is prepared ahead, on a thread of the main process, while the step
before it trains.

Not with it: --decode gpu (DALI is the decoder), worker-side augmentations and --res-start (the
native workers' transforms), --skip-bad-images (DALI fails a whole batch; the native loader names
the file)."""
import collections
import io
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from dlojzlib import compat
from dlojzlib.data.decode import random_resized_crop_params, read_bytes, sample_rng, simplejpeg
from dlojzlib.data.gpu_decode import indexed
from dlojzlib.errors import DataError

INSTALL = ('--loader dali needs NVIDIA DALI, which is not installed: pip install '
           'nvidia-dali-cuda120 (CUDA 12 drivers) or nvidia-dali-cuda130 (CUDA 13), or use '
           '--loader native.')


def dali():
    """The nvidia.dali package, or None."""
    try:
        import nvidia.dali
        return nvidia.dali
    except ImportError:
        return None


_PIPELINES = weakref.WeakSet()  # the DALI pipelines this process built
_FORKED_AWAY = []  # their C++ halves, in a forked child: kept, never shut down there


def _forget_pipelines_in_child():
    """After a fork: a pipeline's threads stayed in the parent, and shutting it down in the child
    (its __del__, at the next garbage collection) crashed the child (measured: a segfault in a
    synthetic-dataset generator forked after a DALI run, whose pool then waited for it forever). The
    child keeps the C++ object unused."""
    for pipe in list(_PIPELINES):
        inner = compat.dali_native_pipeline(pipe)
        if inner is not None:
            _FORKED_AWAY.append(inner)
            compat.detach_dali_native_pipeline(pipe)


os.register_at_fork(after_in_child=_forget_pipelines_in_child)


def image_size(data):
    """(width, height) from the header: libjpeg-turbo's for JPEGs, PIL's for the rest (PNG named
    .JPEG)."""
    if simplejpeg is not None:
        try:
            h, w = simplejpeg.decode_jpeg_header(data)[:2]
            return w, h
        except ValueError:
            pass
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Exception as e:
        raise DataError(f'cannot read an image header ({type(e).__name__}: {e}); --loader native '
                        f'names the file.') from None


class DaliLoader:
    """An iterable of (uint8 (N, 3, s, s), int64 labels) batches, on the CPU or on `device` (a GPU)."""

    def __init__(self, dataset, batch_sampler, train, size, seed, threads=1,
                 device=torch.device('cpu'),
                 val_resize=None):
        self.dataset, self.batch_sampler, self.train = dataset, batch_sampler, train
        self.size, self.seed, self.val_resize = size, seed, val_resize
        self.threads, self.device = max(1, threads), indexed(device)
        self._pipe = None

    def __len__(self):
        return len(self.batch_sampler)

    def summary(self):
        """summary.json's data.dali: DALI's version, where it decodes and its threads."""
        return {'version': dali().__version__,
                'decoder': 'mixed' if self.device.type == 'cuda' else 'cpu',
                'threads': self.threads}

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types
        gpu = self.device.type == 'cuda'
        batch = self.batch_sampler.batch_size  # the largest batch (StepBatchSampler, BatchSampler)

        @pipeline_def(batch_size=batch, num_threads=self.threads,
                      device_id=self.device.index or 0 if gpu else None,
                      exec_async=False, exec_pipelined=False, seed=self.seed)
        def pipe():
            data = fn.external_source(name='data', dtype=types.UINT8, ndim=1)
            decoder = 'mixed' if gpu else 'cpu'
            if self.train:
                anchor = fn.external_source(name='anchor', dtype=types.INT32, ndim=1)
                shape = fn.external_source(name='shape', dtype=types.INT32, ndim=1)
                flip = fn.external_source(name='flip', dtype=types.INT32, ndim=0)
                # the box as drawn from the header's size: no EXIF rotation, as the native paths
                x = fn.decoders.image_slice(data, anchor, shape, axis_names='HW',
                                            output_type=types.RGB,
                                            device=decoder, adjust_orientation=False)
                x = fn.resize(x, resize_x=self.size, resize_y=self.size,
                              interp_type=types.INTERP_LINEAR,
                              antialias=True)
            else:  # torchvision's evaluation: shorter side to val_resize, center crop
                flip = 0
                x = fn.decoders.image(data, output_type=types.RGB, device=decoder,
                                      adjust_orientation=False)
                x = fn.resize(x, resize_shorter=self.val_resize, interp_type=types.INTERP_LINEAR,
                              antialias=True)
            return fn.crop_mirror_normalize(x, dtype=types.UINT8, output_layout='CHW', mirror=flip,
                                            crop=(self.size, self.size), mean=[0.0], std=[1.0])

        p = pipe()
        p.build()
        _PIPELINES.add(p)
        return p

    def _inputs(self, keys):
        """-> (encoded bytes, labels, boxes (top, left, h, w) or None, flips) of a batch's samples."""
        data, labels, boxes, flips = [], [], [], []
        for key in keys:
            index, epoch = key if isinstance(key, tuple) else (key, 0)
            src, label = self.dataset.source(index)
            raw = read_bytes(src)
            data.append(np.frombuffer(raw, dtype=np.uint8))
            labels.append(label)
            if self.train:  # the per-sample RNG of ImageFolderDataset, drawn as FastTrainTransform draws
                rng = sample_rng(self.dataset.seed, epoch, index)
                boxes.append(random_resized_crop_params(rng, *image_size(raw)))
                flips.append(rng.random() < 0.5)
        return data, labels, boxes, flips

    def _batch(self, keys):
        """Feed and run one batch -> (images, labels), on the loader's thread."""
        from nvidia.dali.plugin.pytorch import feed_ndarray
        p = self._pipe
        data, labels, boxes, flips = self._inputs(keys)
        p.feed_input('data', data)
        if self.train:
            p.feed_input('anchor', [np.array(b[:2], np.int32) for b in boxes])
            p.feed_input('shape', [np.array(b[2:], np.int32) for b in boxes])
            p.feed_input('flip', [np.array(int(f), np.int32) for f in flips])
        try:
            (out,) = p.run()
        except RuntimeError as e:
            raise DataError(f'DALI could not decode a batch ({str(e).strip().splitlines()[0]}); '
                            f'--loader native names the file (and --skip-bad-images replaces '
                            f'it).') from None
        out = out.as_tensor()
        x = torch.empty(out.shape(), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device) if self.device.type == 'cuda' else None
        feed_ndarray(out, x, cuda_stream=stream)  # a blocking copy: DALI may reuse its buffer at the next run
        return x, torch.tensor(labels, dtype=torch.int64)

    def __iter__(self):
        """One batch ahead: a thread reads, draws, feeds and runs batch k+1 (DALI's own threads
        decode it, the GIL released) while the caller trains on batch k. Every call into the
        pipeline is made from that one thread; a stop mid-epoch waits for the batch under way and
        starts no other."""
        if self._pipe is None:
            self._pipe = self._build()
        cuda = self.device.type == 'cuda'
        pool = ThreadPoolExecutor(1, thread_name_prefix='dlojz-dali',
                                  initializer=(lambda: torch.cuda.set_device(self.device)) if cuda else None)
        pending = collections.deque()
        try:
            for keys in self.batch_sampler:
                pending.append(pool.submit(self._batch, keys))
                if len(pending) > 1:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
