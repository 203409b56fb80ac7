"""What dlojz picks from the device it runs on, in one place: the optimizer's kernels, --amp auto's
precision, channels-last's default, how often the loss is looked at for NaN, the precisions --tune
sweeps. Each is a function of facts (the device's type, its compute capability, the seam), so that
a CUDA run and a CPU run under DLOJZ_AS_IF_CUDA=1 make the same choice wherever torch can execute
it on the CPU: that is how the CPU tests take the CUDA branches (every defect the first GPU run
found was a branch only a CUDA device took). What needs the device itself keeps its CPU form under
the seam: CUDA events and streams, pinned memory, NCCL, NVML, the GPU decoders, CUDA graphs.
docs/development.md lists every place dlojz branches on the device, and which form the seam takes.

Light: no torch at import."""
import os
from dataclasses import dataclass, field

from dlojzlib import environment

# The GPU a CPU run under the seam answers for: an H100 (compute capability 9.0), where --amp auto
# is bf16, which CPU autocast runs (fp16 needs CUDA's GradScaler and kernels: refused on a CPU)
AS_IF_CAPABILITY = (9, 0)


def native_bf16(capability):
    """Whether a GPU of this (major, minor) compute capability computes bf16 natively: cuDNN does
    from sm80 (Ampere) on. torch.cuda.is_bf16_supported() also counts emulation, which on a V100
    (sm70) sends every convolution down a slow path."""
    return tuple(capability) >= (8, 0)


@dataclass
class Choices:
    """The device's choices for one run. `made`: under the seam, the short names of the CUDA
    choices this run made, in the order made (summary.json's `as_if_cuda`, the header's line)."""
    cuda: bool                  # the CUDA choices are made: a CUDA device, or a CPU under the seam
    as_if_cuda: bool = False    # ... by a CPU run under DLOJZ_AS_IF_CUDA=1
    capability: tuple = None    # the GPU's (major, minor); AS_IF_CAPABILITY under the seam
    made: list = field(default_factory=list)

    def _took(self, name):
        if self.as_if_cuda and name not in self.made:
            self.made.append(name)

    def amp(self, half_refused=False):
        """--amp auto's precision: bf16 where the GPU computes it natively (sm80+), fp16 below,
        off on a CPU. half_refused: the run cannot take fp16's loss scale (FSDP2's slices, a
        pipeline's stages refuse it): off there, on a V100."""
        if not self.cuda:
            return 'off'
        if native_bf16(self.capability):
            self._took('bf16 autocast')
            return 'bf16'
        return 'off' if half_refused else 'fp16'

    def channels_last(self, sharded):
        """channels-last's default: on a GPU, where cuDNN's NHWC convolutions are the fast ones
        (tensor cores), unless FSDP2 slices the parameters (contiguous ones only)."""
        if not self.cuda or sharded:
            return False
        self._took('channels-last')
        return True

    def optimizer_kernels(self, name, dtensors=False, on_host=False, has_foreach=False):
        """The keyword arguments that pick the optimizer's kernels on a GPU: torch's fused SGD and
        AdamW update every parameter in a few launches and take fp16's loss scale and inf flag as
        device tensors (GradScaler.step then reads nothing on the host); DTensor has no sharding
        rule for aten._fused_sgd_ (torch 2.14 lists only the fused Adam and AdamW), so SGD
        over FSDP2's parameters (dtensors) takes the multi-tensor foreach path, which DTensor
        runs; timm's LARS, LAMB and Lion take foreach where they have it (has_foreach). on_host:
        the optimizer steps on the CPU (--cpu-offload), as on a CPU run."""
        if not self.cuda or on_host:
            return {}
        if name in ('sgd', 'adamw') and not (name == 'sgd' and dtensors):
            self._took(f'fused {name}')
            return {'fused': True}
        if name == 'sgd' or has_foreach:
            self._took(f'foreach {name}')
            return {'foreach': True}
        return {}

    def nan_check_every(self, findlr=False):
        """NonFiniteGuard's interval: 1 (every step) on a CPU, where reading the loss is free; 0 (at
        each log line, in the same read as the line's loss) on a GPU, where each read waits for
        the device. The LR sweep reads its loss every step anyway and stops on its own."""
        if findlr:
            return 0
        if self.cuda:
            self._took('NaN check at log lines')
            return 0
        return 1

    def tune_sweep(self):
        """-> (the GPU's sweep, bf16, fp16) for --tune's configurations: on a GPU its precisions
        (bf16 where native) x layouts x compile modes (CUDA graphs' with channels-last); on a CPU
        eager fp32 and bf16 autocast; under the seam the GPU's sweep without fp16, which a CPU
        refuses."""
        if not self.cuda:
            return False, True, False
        self._took('the GPU tune sweep')
        return True, native_bf16(self.capability), not self.as_if_cuda


def choose(device_type, capability=None, as_if_cuda=False):
    """-> the Choices of a device of this type ('cuda', 'cpu'); capability: a GPU's (major,
    minor); as_if_cuda: DLOJZ_AS_IF_CUDA=1, which a CPU run answers as an H100 would (a CUDA
    device is not changed by it)."""
    seam = as_if_cuda and device_type == 'cpu'
    if seam:
        return Choices(cuda=True, as_if_cuda=True, capability=AS_IF_CAPABILITY)
    if device_type == 'cuda':
        return Choices(cuda=True, capability=tuple(capability) if capability else None)
    return Choices(cuda=False)


def of(device, capability=None, environ=os.environ):
    """choose() for a torch.device: a GPU's capability asked from CUDA unless given, the seam read
    from the environment (environment.as_if_cuda)."""
    if device.type == 'cuda' and capability is None:
        import torch
        capability = torch.cuda.get_device_capability(device)
    return choose(device.type, capability, environment.as_if_cuda(environ))
