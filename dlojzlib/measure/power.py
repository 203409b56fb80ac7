"""GPU power and energy through NVML (the PowerMeter), read off the hot path: the whole run's
energy, the steady training steps' energy for J/image, peak and mean power. The GPU is found in NVML
by UUID, then PCI address, never by CUDA index."""
import statistics
import threading
import time

import torch


def _hex(uuid):
    """'GPU-5f0b5c3e-...' (NVML), '5f0b5c3e-...' (torch) or bytes -> '5f0b5c3e...' to compare."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.lower().removeprefix('gpu-').removeprefix('mig-').replace('-', '')


def nvml_handle(nvml, props):
    """The NVML handle of the GPU whose torch device properties are `props`, or (None, why).

    NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, while CUDA numbers the visible
    ones (fastest first by default), so a CUDA index is not an NVML index: match the UUID, else the
    PCI address (a MIG instance has its own UUID but its parent's PCI address: the parent's energy
    is then shared)."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    uuid = getattr(props, 'uuid', None)  # torch >= 2.5
    for h in handles:
        if uuid is not None and _hex(nvml.nvmlDeviceGetUUID(h)) == _hex(uuid):
            return h, None
    fields = ('pci_domain_id', 'pci_bus_id', 'pci_device_id')  # torch >= 2.8
    address = tuple(getattr(props, k, None) for k in fields)
    for h in handles:
        pci = nvml.nvmlDeviceGetPciInfo(h)
        if None not in address and (pci.domain, pci.bus, pci.device) == address:
            return h, None
    if uuid is None and None in address:
        return None, (f'torch {torch.__version__} gives no UUID or PCI address for CUDA device '
                      f'{props.name}')
    return None, f'no NVML device has the UUID or PCI address of CUDA device {props.name}'


class PowerMeter:
    """GPU power and energy through NVML, off the hot path.

    Energy comes from the board's cumulative counter (nvmlDeviceGetTotalEnergyConsumption, mJ): over
    the whole run (start to stop) and over the steady training windows (window_start/window_stop
    around the steps after warm-up, excluding validation, compilation and start-up), which is what
    J/image divides. Peak and mean power come from a background thread sampling
    nvmlDeviceGetPowerUsage (mW) every `period` seconds. Unavailable (CPU, no driver, no
    nvidia-ml-py, GPU not found): every field None, never guessed. `nvml` and `props` replace pynvml
    and torch's device properties in tests.

    The counter is the board's: ranks sharing a GPU (--share-gpu, MPS, MIG instances of one board)
    each read all of its energy. gather(x) -> every rank's x (dist.launch.all_gather_object, a
    collective) tells the meter how many ranks read its board (share()); J/image then divides the
    board's energy by the images of all of them (ranks train the same number of images per step),
    and report() gives each rank its share, so that sums over ranks count every board once.
    """

    def __init__(self, device, period=0.1, nvml=None, props=None, synchronize=None, gather=None):
        self.available, self.samples, self.period = False, [], period
        self.energy_j, self.why = None, 'not a CUDA device'
        self.board = None  # the board's NVML UUID (hex)
        self.ranks_on_board = 1  # the ranks that read its counter
        self.train_energy_j, self.train_images, self._window = 0.0, 0, None
        self._stop = threading.Event()
        self._thread = None
        dev = torch.device(device)
        if dev.type != 'cuda':
            return
        self._synchronize = synchronize or torch.cuda.synchronize
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            props = props or torch.cuda.get_device_properties(dev)
            self._nvml = nvml
            self._handle, self.why = nvml_handle(nvml, props)
            self.available = self._handle is not None
            if self.available:
                self.board = _hex(nvml.nvmlDeviceGetUUID(self._handle))
        except Exception as e:  # no NVML on this machine: power is unavailable, never guessed
            self.why = f'NVML unavailable ({type(e).__name__}: {e})'
        if gather is not None:  # a collective: every rank of a GPU run builds its meter
            self.share(gather(self.board))

    def _energy_mj(self):
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except Exception:
            return None

    def _sample(self):
        while not self._stop.wait(self.period):
            try:
                self.samples.append(self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3)
            except Exception:
                return

    def start(self):
        if not self.available:
            return
        self._t0, self._e0 = time.perf_counter(), self._energy_mj()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def window_start(self):
        """Training steps after warm-up begin. One synchronisation, so that the warm-up's queued GPU
        work is not counted (once per epoch, outside any timed step)."""
        if self._thread is not None and self._window is None and not self._stop.is_set():
            self._synchronize()
            self._window = self._energy_mj()

    def window_stop(self, images):
        """The steady training steps since window_start, `images` images in all, have completed (the
        caller has synchronised)."""
        if self._window is None:
            return
        e1, e0, self._window = self._energy_mj(), self._window, None
        if e0 is not None and e1 is not None:
            self.train_energy_j += (e1 - e0) / 1e3
            self.train_images += images

    def stop(self):
        """Idempotent: every exit path of a run calls it."""
        if self._thread is None or self._stop.is_set():
            return
        self._window = None  # a window still open (an error inside the loop) is not counted
        self._stop.set()
        self._thread.join()
        e1, seconds = self._energy_mj(), time.perf_counter() - self._t0
        if self._e0 is not None and e1 is not None:
            self.energy_j = (e1 - self._e0) / 1e3
        elif self.samples:  # no energy counter (pre-Volta boards): integrate the samples
            self.energy_j = statistics.fmean(self.samples) * seconds

    def share(self, boards):
        """boards: the board of every rank (None where unknown), e.g. gathered from all ranks."""
        if self.board is not None:
            self.ranks_on_board = max(1, list(boards).count(self.board))

    def report(self):
        """This rank's share of its board's energy (J) and its images, for sums over ranks."""
        n = self.ranks_on_board
        return {'energy_j': self.energy_j / n if self.energy_j is not None else None,
                'train_energy_j': self.train_energy_j / n, 'train_images': self.train_images,
                'ranks_on_board': n}

    def summary(self):
        peak = max(self.samples) if self.samples else None
        mean = statistics.fmean(self.samples) if self.samples else None
        images = self.train_images * self.ranks_on_board  # the board's, in the steady windows
        per_image = self.train_energy_j / images if images else None
        # each null figure's reason, which the '>>> Peak Power' line prints
        gone = None if self.available else self.why
        why = {'peak_w': f'no power sample was taken (one every {self.period:g} s)',
               'energy_j': 'the board gave no energy count and no power sample',
               'joules_per_image': 'no steady training step was measured'}
        figures = {'peak_w': peak, 'energy_j': self.energy_j, 'joules_per_image': per_image}
        unmeasured = {k: gone or why[k] for k, v in figures.items() if v is None}
        return {'available': self.available, 'unmeasured': unmeasured,
                'why_unavailable': gone,
                'board': self.board, 'ranks_on_board': self.ranks_on_board,
                'peak_w': peak, 'mean_w': mean, 'energy_j': self.energy_j,
                'train_energy_j': self.train_energy_j if self.train_images else None,
                'train_images': self.train_images, 'joules_per_image': per_image}
