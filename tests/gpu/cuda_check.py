"""Does this node give torch a CUDA GPU it has kernels for, and can inductor compile there? bash
tests/gpu/run.sh asks before any test: a line with torch's CUDA version, the driver and the GPUs,
and with --compile a line with the C compiler and Python's headers that Triton (inductor's GPU
backend) builds its launchers with (exit 0); or one sentence saying what is missing and what to do
(exit 1).

Run: python tests/gpu/cuda_check.py [--compile]
"""
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig

# The oldest driver each CUDA major release runs on (Linux, CUDA minor-version compatibility: NVIDIA's
# "CUDA Compatibility" guide, table 1): a wheel built for CUDA 12.8 runs on a 525 driver, one for 13.0 needs 580.
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def verdict(torch_version, cuda_version, driver, gpus, arch_list, host='this node'):
    """-> (ok, line). cuda_version: torch.version.cuda (None for a CPU-only build); driver: the NVIDIA driver
    version string, or None when none answers; gpus: [(name, (major, minor))] that torch sees; arch_list:
    torch.cuda.get_arch_list() ('sm_90', ...)."""
    fix = 'install the torch build for this driver (tests/gpu/README.md) and run again'
    if cuda_version is None:
        return False, f'tests/gpu needs CUDA and torch {torch_version} is a CPU-only build; {fix}.'
    if driver is None:
        return False, (f'tests/gpu needs CUDA and torch {torch_version} (CUDA {cuda_version}) finds no NVIDIA driver '
                       f'on {host}; run it on a GPU node (e.g. srun --gres=gpu:1 bash tests/gpu/run.sh).')
    need = MIN_DRIVER.get(int(cuda_version.split('.')[0]))
    if need and int(driver.split('.')[0]) < need:
        return False, (f'tests/gpu needs CUDA and torch {torch_version} is built for CUDA {cuda_version}, which needs '
                       f'NVIDIA driver {need} or newer, but this node has {driver}; {fix}.')
    if not gpus:
        return False, (f'tests/gpu needs CUDA and torch {torch_version} (CUDA {cuda_version}, driver {driver}) sees no '
                       f'GPU on {host} (CUDA_VISIBLE_DEVICES={os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}); '
                       f'ask the allocation for one (--gres=gpu:1).')
    # below the oldest architecture the wheel was built for there is nothing to run (newer GPUs may run PTX):
    # a V100 (sm70) with a CUDA 13 wheel, whose oldest is sm75
    have = [int(a.split('_')[1]) for a in arch_list if a.startswith('sm_')]
    old = [(name, cap) for name, cap in gpus if have and 10 * cap[0] + cap[1] < min(have)]
    if old:
        return False, (f'tests/gpu: torch {torch_version} (CUDA {cuda_version}) has no kernels for the '
                       f'{old[0][0]} (sm{10 * old[0][1][0] + old[0][1][1]}; the oldest it has is sm_{min(have)}); '
                       f'install a CUDA 12.6 build (tests/gpu/README.md) and run again.')
    names = ', '.join(sorted({f'{sum(1 for g in gpus if g == x)} x {x[0]} (sm{10 * x[1][0] + x[1][1]})' for x in gpus}))
    return True, f'CUDA: torch {torch_version} built for CUDA {cuda_version}, driver {driver}, {names}'


def compile_verdict(compiler, headers, python=platform.python_version()):
    """-> (ok, line). compiler: (path, first line of its --version) of the C compiler Triton would
    use, or None; headers: the path of Python.h, or None where it is absent."""
    fix = 'or pass --no-compile to bash tests/gpu/run.sh to leave the compiled checks out'
    if compiler is None:
        return False, ('--compile needs a C compiler (Triton builds its GPU launchers with '
                       'cc/gcc) and this node has none on PATH; install gcc (apt-get install gcc), '
                       f'set CC, {fix}.')
    if headers is None:
        return False, (f"--compile needs Python {python}'s headers (Triton compiles against "
                       'Python.h) and this node lacks them; install them (apt-get install '
                       f'python3-dev, or the python module with headers), {fix}.')
    return True, f'compile: {compiler[1]} ({compiler[0]}), {headers}'


def c_compiler():
    """The compiler Triton looks for (CC, then cc, gcc, clang) and its --version's first line, or
    None."""
    for name in [os.environ.get('CC'), 'cc', 'gcc', 'clang']:
        path = name and shutil.which(name)
        if path:
            try:
                out = subprocess.run([path, '--version'], capture_output=True, text=True,
                                     timeout=30).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            return path, (out.splitlines() or [name])[0].strip()
    return None


def python_headers():
    path = os.path.join(sysconfig.get_paths()['include'], 'Python.h')
    return path if os.path.exists(path) else None


def driver_version():
    try:
        import pynvml
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:  # no library, no driver, no device: ask nvidia-smi
        pass
    try:
        out = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def main():
    try:
        import torch
    except ImportError as e:
        print(f'tests/gpu needs torch and {sys.executable} cannot import it ({e}); activate the venv or set '
              f'PYTHON=/path/to/venv/bin/python.', file=sys.stderr, flush=True)
        return 1
    available = torch.cuda.is_available()
    gpus = [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())] if available else []
    ok, line = verdict(torch.__version__, torch.version.cuda, driver_version(), gpus,
                       torch.cuda.get_arch_list() if available else [], socket.gethostname())
    if ok and '--compile' in sys.argv[1:]:
        print(line, flush=True)
        ok, line = compile_verdict(c_compiler(), python_headers())
    print(line, file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
