"""--decode gpu: the workers read each training image's bytes and draw its crop and flip
(GpuTrainTransform -> EncodedBatch); the main process decodes the batch on the GPU (nvImageCodec,
else torchvision's nvJPEG), which crops, resizes and flips as batched work (DeviceDecode,
data.resize), one batch ahead of training (DecodeAhead). The draws are the host paths'
(data.decode), from the same per-sample RNG."""
import collections
import io
import multiprocessing as mp
import re
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from dlojzlib.data import nvdecode, region, resize
from dlojzlib.data.decode import (BadImageError, Blob, load_rgb, random_resized_crop_params,
                                  read_bytes, source_name)


@dataclass
class Encoded:
    """A training sample on its way to the device: its JPEG bytes and its draws (crop box in the
    source's pixels, flip)."""
    data: torch.Tensor  # uint8, 1-D
    box: tuple          # (top, left, height, width, flip)
    name: str


def nvjpeg_size(data):
    """(width, height) of a JPEG that nvJPEG decodes to RGB (YCbCr or grayscale), else None:
    CMYK/YCCK, PNG named .JPEG, unreadable headers. PIL reads the header only (the pixels stay
    encoded)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size if img.format == 'JPEG' and img.mode in ('RGB', 'L') else None
    except Exception:  # not an image PIL knows: the CPU path names it
        return None


class GpuTrainTransform:
    """--decode gpu, worker side: read the file, draw the crop box from the JPEG header's size and
    the flip, hand the bytes on. Files nvJPEG would refuse are decoded here by the CPU path (same
    draws) and counted."""
    decode = 'gpu'

    def __init__(self, size, cpu):
        self.size, self.cpu = size, cpu
        # shared with the workers, read by the summary
        self.in_workers = mp.get_context('fork').Value('i', 0)

    def __call__(self, src, rng):
        data = read_bytes(src)
        size = nvjpeg_size(data)
        if size is None:
            with self.in_workers.get_lock():
                self.in_workers.value += 1
            return self.cpu(src, rng)
        top, left, h, w = random_resized_crop_params(rng, *size)
        box = (top, left, h, w, rng.random() < 0.5)
        return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, source_name(src))


class EncodedBatch:
    """A --decode gpu batch as it leaves the workers: the encoded samples' bytes in one tensor (one
    shared memory block per batch, not one per image), their boxes, and the few samples already
    decoded on CPU. .to(device) decodes it there -> uint8 (N, 3, size, size), like the other paths'
    batches."""

    def __init__(self, samples, size):
        self.size, self.n = size, len(samples)
        self.replaced = []  # (i, j): after .to(), sample j stands in for the undecodable sample i
        self.at = [i for i, x in enumerate(samples) if isinstance(x, Encoded)]
        encoded = [samples[i] for i in self.at]
        self.sizes = [x.data.numel() for x in encoded]
        self.data = (torch.cat([x.data for x in encoded]) if encoded
                     else torch.empty(0, dtype=torch.uint8))
        self.boxes = [x.box for x in encoded]
        self.names = [x.name for x in encoded]
        decoded = [x for x in samples if not isinstance(x, Encoded)]
        self.pixels = (torch.stack(decoded) if decoded
                       else torch.empty(0, 3, size, size, dtype=torch.uint8))

    def __len__(self):
        return self.n

    def pin_memory(self, device=None):  # called by the DataLoader's pin-memory thread
        self.data, self.pixels = self.data.pin_memory(), self.pixels.pin_memory()
        return self

    def to(self, device, non_blocking=False):
        return DEVICE_DECODE(self, indexed(device), non_blocking)


class GpuCollate:
    """collate_fn of the training loader for --decode gpu: (EncodedBatch, int64 labels)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, batch):
        samples, labels = zip(*batch)
        return EncodedBatch(list(samples), self.size), torch.tensor(labels, dtype=torch.int64)


def decodes_lists(torchvision_version):
    """Whether this torchvision's decode_jpeg takes a list of images (one batched nvJPEG call). 0.19
    takes one tensor only: its decode_jpeg hands `input` straight to
    torch.ops.image.decode_jpeg_cuda, whose schema refuses a list (RuntimeError); the list form and
    its op decode_jpegs_cuda ship in 0.20 (pytorch/vision#8496), on CPU too (one libjpeg-turbo call
    per element)."""
    major, minor = (int(x) for x in re.match(r'(\d+)\.(\d+)', torchvision_version).groups())
    return (major, minor) >= (0, 20)


def lacks_jpeg_engine(capability):
    """Whether a GPU of this compute capability surely has no hardware JPEG decoder, so that nvJPEG
    decodes on its hybrid CPU/CUDA path, one image at a time with a stream synchronisation each:
    below sm80 (V100, T4). A100/A30 (sm80) and H100 (sm90) have the engine; capability is only a
    proxy above that (some sm86 cards, A10 or RTX 30, lack it and are not warned about)."""
    return tuple(capability) < (8, 0)


SM70_WARNING = ('--decode gpu on a GPU without a hardware JPEG decoder (compute capability {}.{}, '
                'e.g. V100): nvJPEG decodes image by image with a host synchronisation each, '
                'usually slower than --decode fast with enough workers; compare them with '
                '--loader-only.')


class DecodedBatch:
    """A --decode gpu batch decoded by DeviceDecode.decoded(): uint8 (N, 3, size, size) on the
    device, ready once `event` has passed on the decoder's stream. .to() makes the caller's stream
    wait for that event (a device-side wait, no host sync) and marks the images as used by it, so
    that their memory is not reused before the step that reads them has run."""

    def __init__(self, images, replaced, event):
        self.images, self.replaced, self.event = images, replaced, event

    def __len__(self):
        return len(self.images)

    def to(self, device, non_blocking=False):
        if self.event is not None:
            stream = torch.cuda.current_stream(self.images.device)
            stream.wait_event(self.event)
            self.images.record_stream(stream)
        return self.images


def indexed(device):
    """`device` as a torch.device with its index: 'cuda' alone is the current GPU.
    torch.cuda.set_device refuses a device without one, and a thread pool whose initializer raises
    fails its first task."""
    device = torch.device(device)
    if device.type == 'cuda' and device.index is None:
        return torch.device('cuda', torch.cuda.current_device())
    return device


class DeviceDecode:
    """EncodedBatch.to(device): the batch decoded on the device, then cropped, resized and flipped
    there as batched work (data.resize). The decoder is nvImageCodec where it can (data.nvdecode:
    the batch in one call per backend, each crop only, the GPU's hardware JPEG engine first, the
    images each backend decoded counted), else torchvision's decode_jpeg (nvJPEG's CUDA backend,
    whole images: the batch in one call from torchvision 0.20, image by image on 0.19); which one,
    and why not nvImageCodec, is said once and kept in summary.json (record). What nvImageCodec
    refuses goes to torchvision's; what nvJPEG refuses is decoded by PIL on the host, same box, and
    counted; an image PIL cannot read either stops the run with its name, or with --skip-bad-images
    is replaced by the batch's previous sample and counted. The first refusal is printed with the
    decoder's own message, once: a decoder that refuses everything must not pass for a slow run.

    Streams, on CUDA: two of our own per device, for the whole run. torchvision's CUDA decode_jpeg
    allocates its outputs on the current stream but writes them from a private stream that does not
    wait for it, so a block just freed by queued kernels can be overwritten while they still read it
    (pytorch/vision#9606). Decoding with the `decode` stream current keeps its outputs in that
    stream's pool, which only ever holds earlier decode outputs, released once the `geometry`
    stream, which crops and resizes them, is done (record_stream). nvImageCodec decodes on the
    decode stream (its cuda_stream) into buffers of its own, which are copied there into one of
    torch's before they are let go. decode_jpeg waits on the host for its own stream (its
    cudaStreamSynchronize), not for the training stream. The batch is ready at an event on the
    geometry stream, which the training stream waits for when it takes the batch (DecodedBatch.to),
    so that decoding can run ahead, on another thread (DecodeAhead), while the training stream holds
    queued work."""

    def __init__(self, torchvision_version=torchvision.__version__, nvimgcodec=None):
        self.decode_jpeg = decode_jpeg  # seam: tests make it refuse
        self.lists = decodes_lists(torchvision_version)
        self.torchvision_version = torchvision_version
        self.refused = 0                # images nvJPEG refused, decoded by PIL
        self.nv_refused = 0             # images nvImageCodec refused, decoded by torchvision's
        self.bad = 0                    # images nothing could decode (--skip-bad-images)
        self.skip_bad_images = False
        self.warned = False             # the first refusal has been printed
        self._streams, self.warnings_checked = {}, False
        # (module or None, why not): (None, why) makes torchvision's decode; None: nvImageCodec,
        # imported where its decoder is made, unless region.REGION.why_not says why not
        self.nvimgcodec = nvimgcodec
        self._nv = {}                   # device -> its NvDecoder, or None where torchvision decodes
        self._nv_works = set()          # the devices where nvImageCodec has decoded an image
        self._counts = {}               # device -> images per nvImageCodec backend (NvDecoder's)
        self.decoder = self.why_not = None  # what decodes ('nvimgcodec 0.9.0.20'), why not it
        self.libnvjpeg = None           # the libnvjpeg nvImageCodec bound (/proc/self/maps)

    def __call__(self, batch, device, non_blocking=False):
        return self.decoded(batch, device, non_blocking).to(device)

    def decoded(self, batch, device, non_blocking=False):
        """-> DecodedBatch: `batch` decoded, cropped, resized and flipped, queued on this decoder's
        streams."""
        streams = self._streams_of(device)
        if streams is None:
            images = self._assemble(batch, device, non_blocking, None)
            return DecodedBatch(images, batch.replaced, None)
        with torch.cuda.stream(streams['geometry']):
            images = self._assemble(batch, device, non_blocking, streams)
            event = torch.cuda.Event()
            event.record(streams['geometry'])
        return DecodedBatch(images, batch.replaced, event)

    def _streams_of(self, device):
        """{'decode', 'geometry'} streams of `device`, made once per run; None off CUDA."""
        if device.type != 'cuda':
            return None
        if device not in self._streams:
            self._streams[device] = {'decode': torch.cuda.Stream(device),
                                     'geometry': torch.cuda.Stream(device)}
            capability = torch.cuda.get_device_capability(device)
            if lacks_jpeg_engine(capability):
                print(f'dlojz: warning: {SM70_WARNING.format(*capability)}', file=sys.stderr,
                      flush=True)
        return self._streams[device]

    def _nv_of(self, device):
        """nvImageCodec's decoder for `device`, made once, or None where torchvision decodes (the
        reason said once). nvImageCodec is imported here, in the thread that decodes once it is on
        the run's GPU (DecodeAhead), never at `import dlojz`."""
        if device not in self._nv:
            lib, why = self.nvimgcodec or (None, region.REGION.why_not)
            # the installed wheels' CUDA majors matter only for a GPU (a scan of every distribution)
            gpu = why is None and device.type == 'cuda'
            wheels = nvdecode.wheel_cuda_major(nvdecode.installed_names()) if gpu else []
            ok, why = nvdecode.usable(why, device, torch.version.cuda, wheels)
            self._nv[device] = None
            try:
                if ok:
                    lib = lib or region.import_nvimgcodec()
                    self._nv[device] = nvdecode.NvDecoder(lib, device)
            except ImportError as e:  # found but broken (a library it links is missing)
                ok, why = False, f'nvImageCodec could not be imported ({str(e).strip()[:120]})'
            except RuntimeError as e:  # its CUDA runtime refuses this driver or device
                ok, why = False, (f'nvImageCodec could not start on {device} '
                                  f'({str(e).strip()[:120]})')
            if not ok:
                self._use(None, why)
            else:  # nvImageCodec's nvJPEG extension has bound its libnvjpeg by now
                self.libnvjpeg = nvdecode.bound_nvjpeg()
                self._use(f'nvimgcodec {region.nvimgcodec_version() or lib.__version__}', None)
        return self._nv[device]

    def _use(self, decoder, why_not):
        """Which decoder decodes ('nvimgcodec 0.9.0.20'; None: torchvision's) and why not
        nvImageCodec. torchvision's is said at once; nvImageCodec after its first batch, with the
        backends that decoded it (decode)."""
        self.decoder = decoder or f'torchvision {self.torchvision_version}'
        self.why_not = why_not
        if decoder is None:
            print(f'dlojz: --decode gpu: torchvision\'s decode_jpeg decodes whole images '
                  f'(nvJPEG\'s CUDA decoder): {why_not}', file=sys.stderr, flush=True)

    def backend_counts(self):
        """The images each nvImageCodec backend decoded ({'hardware': n, 'cuda': n, 'hybrid': n}
        on a GPU, {'cpu': n} on the CPU), over the devices; None where torchvision's decoded from
        the start."""
        total = {}
        for counts in self._counts.values():
            for name, n in counts.items():
                total[name] = total.get(name, 0) + n
        return total or None

    def record(self):
        """summary.json's data.gpu_decode, this decoder's part: which decoder decoded, why not
        nvImageCodec, its backends' counts and the libnvjpeg it bound, and the images the
        fallbacks decoded."""
        return {'decoder': self.decoder, 'why_not_nvimgcodec': self.why_not,
                'nvimgcodec_backends': self.backend_counts(), 'libnvjpeg': self.libnvjpeg,
                'torchvision_after_nvimgcodec': self.nv_refused, 'cpu_after_nvjpeg': self.refused}

    def _assemble(self, batch, device, non_blocking, streams):
        """-> uint8 (N, 3, size, size) in the batch's order: the samples decoded on the device and
        those the workers decoded on the host; sets batch.replaced (--skip-bad-images)."""
        out = [None] * batch.n
        if batch.at:
            chunks = list(torch.split(batch.data, batch.sizes))
            decoded = self.decode(chunks, batch.boxes, batch.names, device, streams)
            good = [k for k, d in enumerate(decoded) if d is not None]
            if good:
                boxes = [(*decoded[k][1], batch.boxes[k][4]) for k in good]
                done = resize.resized_crops([decoded[k][0] for k in good], boxes, batch.size)
                for k, img in zip(good, done):
                    out[batch.at[k]] = img
        if batch.pixels.numel():
            pixels = batch.pixels.to(device, non_blocking=non_blocking)
            for j, i in enumerate(sorted(set(range(batch.n)) - set(batch.at))):
                out[i] = pixels[j]
        good = [i for i, x in enumerate(out) if x is not None]
        if not good:
            raise BadImageError(f'no image of a batch could be decoded ({", ".join(batch.names)}); '
                                f'check the data directory.')
        # a bad image's place goes to the nearest earlier good sample, image and label (to_device
        # reads batch.replaced for the label)
        batch.replaced = [(i, max((g for g in good if g < i), default=good[0]))
                          for i, x in enumerate(out) if x is None]
        for i, j in batch.replaced:
            out[i] = out[j]
        return torch.stack(out)

    def decode(self, chunks, boxes, names, device, streams=None):
        """-> for each image, (uint8 (3, H, W) on the device, the crop's (top, left, height, width)
        in it), or None where no decoder could read it (--skip-bad-images)."""
        out = [None] * len(chunks)
        nv = self._nv_of(device)
        if nv is not None:
            stream = streams['decode'] if streams else None
            crops = self._on_device(lambda: owned(nv(chunks, boxes, stream)), device, streams)
            self._counts[device] = nv.counts  # the decoder's own, updated at each call
            refused = sum(c is None for c in crops)
            if device not in self._nv_works and refused < len(crops):  # the first batch: said once
                self._nv_works.add(device)
                said = nvdecode.first_batch_sentence(self.decoder.split()[1], nv.counts, refused)
                print(f'dlojz: --decode gpu: {said}', file=sys.stderr, flush=True)
            elif device not in self._nv_works:  # nothing decoded yet, not one image of a batch
                self._nv[device] = None
                self._use(None, f'nvImageCodec decoded none of the first batch\'s {len(crops)} '
                                f'images on {device} (its GPU decoder did not load?)')
            for k, crop in enumerate(crops):
                if crop is not None:
                    out[k] = crop, (0, 0, *crop.shape[1:])
            self.nv_refused += refused
        rest = [k for k, d in enumerate(out) if d is None]
        if rest:
            images = self._torchvision([chunks[k] for k in rest], [names[k] for k in rest], device,
                                       streams)
            for k, img in zip(rest, images):
                out[k] = None if img is None else (img, boxes[k][:4])
        return out

    def _torchvision(self, chunks, names, device, streams=None):
        """torchvision's decode_jpeg -> the whole images, None where no decoder could read one
        (--skip-bad-images)."""
        if self.lists:
            try:
                return self._on_device(lambda: self._call(chunks, device), device, streams)
            except RuntimeError as e:  # one image spoils the batch: find it below
                self._warn(e, 'a batch')
        images = []
        for chunk, name in zip(chunks, names):
            try:
                images += self._on_device(lambda: self._call([chunk], device), device, streams)
            except RuntimeError as e:
                self._warn(e, name)
                self.refused += 1
                images.append(self._on_host(chunk, name, device))
        return images

    def _warn(self, e, what):
        if not self.warned:
            self.warned = True
            said = str(e).strip().splitlines()[0]
            print(f'dlojz: warning: nvJPEG refused {what} ({type(e).__name__}: {said}); '
                  f'what it refuses is decoded by PIL on the host and counted in summary.json '
                  f'(data.gpu_decode.cpu_after_nvjpeg)', file=sys.stderr, flush=True)

    def _on_host(self, chunk, name, device):
        try:
            img = load_rgb(Blob(chunk.numpy().tobytes(), name))
        except BadImageError:
            if not self.skip_bad_images:
                raise
            self.bad += 1
            print(f'dlojz: warning: skipped bad image {name}; using the batch\'s previous sample '
                  f'instead',
                  file=sys.stderr, flush=True)
            return None
        return torch.from_numpy(np.array(img)).permute(2, 0, 1).to(device)

    def _decode(self, data, device):
        """self.decode_jpeg, with torchvision's deprecation of its decoders (0.29 and later, in
        favour of TorchCodec, which dlojz does not depend on and which has no nvJPEG batch decode
        into the caller's stream) said once per process instead of at every batch; any other warning
        passes through. The first call looks (catch_warnings, which changes the process's warning
        state and is not thread-safe: the decode thread must not hold it at every batch); from then
        on a filter silences that one message, or nothing if this torchvision does not warn."""
        if self.warnings_checked:
            return self.decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always', DeprecationWarning)
            images = self.decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        self.warnings_checked = True
        codec = [w for w in caught
                 if issubclass(w.category, DeprecationWarning) and 'TorchCodec' in str(w.message)]
        if codec:
            warnings.filterwarnings('ignore', message='.*TorchCodec', category=DeprecationWarning)
            print('dlojz: note: torchvision deprecates decode_jpeg, which --decode gpu uses '
                  '(nvJPEG), for TorchCodec; it still works here; --decode fast does without it.',
                  file=sys.stderr, flush=True)
        for w in caught:
            if w not in codec:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return images

    def _call(self, chunks, device):
        """decode_jpeg as this torchvision takes it: the list in one call (>= 0.20), else one tensor
        per call (0.19). The CPU seam the tests drive goes through the same choice, with
        libjpeg-turbo."""
        if self.lists:
            return self._decode(chunks, device)
        return [self._decode(c, device) for c in chunks]

    def _on_device(self, call, device, streams):
        """call() (a decode) with the decode stream current; the current (geometry) stream waits for
        it and is recorded on its outputs, which it reads."""
        if streams is None:
            return call()
        reader = torch.cuda.current_stream(device)
        with torch.cuda.stream(streams['decode']):
            images = call()
        reader.wait_stream(streams['decode'])
        for img in images:
            if img is not None:
                img.record_stream(reader)
        return images


def owned(images):
    """A decoder's outputs (None where it failed) copied, on the current stream, into one of torch's
    allocations: views of it in their place. nvImageCodec's buffers are its own, freed when their
    images go, in its own stream order, where torch's record_stream cannot follow them."""
    good = [x for x in images if x is not None]
    if not good:
        return images
    parts = iter(torch.cat([x.reshape(-1) for x in good]).split([x.numel() for x in good]))
    return [None if x is None else next(parts).view(x.shape) for x in images]


class DecodeAhead:
    """The training loader of --decode gpu, each batch decoded while the step before it trains: a
    thread decodes batch k+1 (nvJPEG's host work and its kernel launches, the GIL released inside
    torch's ops) while the training thread queues step k, and the training stream waits for the
    decode on the device only (DecodedBatch.to). The batches and their order are the loader's; the
    DataLoader is only touched from the calling thread. At most `depth` batches are decoded and not
    yet taken (~N*3*size^2 bytes each on the device: 38 MB at 256 x 224 px). An error in the decode
    (a bad image) is raised when its batch is taken."""

    def __init__(self, loader, device, decoder=None, depth=1):
        self.loader, self.device, self.depth = loader, indexed(device), depth
        self.decoder = decoder

    def __len__(self):
        return len(self.loader)

    def _decode(self, item):
        batch, labels = item
        decoder = self.decoder or DEVICE_DECODE
        return decoder.decoded(batch, self.device, non_blocking=True), labels

    def __iter__(self):
        it = iter(self.loader)  # the workers start (fork) before the thread does
        pending = collections.deque()
        # a new thread's current CUDA device is 0 whatever this rank's is: set it, so that what
        # torch allocates or launches without naming a device lands on this rank's GPU, and so that
        # torchvision's decoder (made in this thread, and keeping the device current then) orders
        # its output on this device's current stream, our decode stream, and not on device 0's
        # (decode_jpegs_cuda.cpp: original_device)
        on_device = ((lambda: torch.cuda.set_device(self.device)) if self.device.type == 'cuda'
                     else None)
        pool = ThreadPoolExecutor(1, thread_name_prefix='dlojz-decode', initializer=on_device)
        try:
            for item in it:
                pending.append(pool.submit(self._decode, item))
                if len(pending) > self.depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # a stop mid-epoch: the decode under way ends, the queued ones do not start
            pool.shutdown(wait=True, cancel_futures=True)


DEVICE_DECODE = DeviceDecode()  # one per process: only the main process decodes on the device
