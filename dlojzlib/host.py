"""The host a run measures on: usable cores, torch's intra-op threads, the node's load and the
process's memory, and provenance (versions, device, driver, git sha) for every result."""
import datetime
import gc
import hashlib
import os
import platform
import socket
import subprocess
import sys
import time

import torch

from dlojzlib import ROOT, SCRIPT
from dlojzlib.environment import read

PROCESS_T0 = time.time()  # process_start_time()'s fallback: when this module was imported


def process_start_time(stat='/proc/self/stat', proc_stat='/proc/stat'):
    """When this process started (seconds since the epoch, time.time()'s clock): the kernel's start
    time of the process (clock ticks after boot) plus the boot time; where /proc does not say (not
    Linux), when this module was imported."""
    try:
        with open(stat) as f:
            ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # field 22, counted after the command name
        with open(proc_stat) as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith('btime '))
        return boot + ticks / os.sysconf('SC_CLK_TCK')
    except (OSError, ValueError, IndexError, StopIteration):
        return PROCESS_T0


def freeze_imports():
    """dlojz.py's first step after the imports: the objects they made (modules, classes, functions:
    ~346 000 with torch, timm and torchvision) live as long as the process, so the collector stops
    scanning them (gc.freeze). A full collection took 0.16 s (this machine, 2 cores) and came
    wherever the allocations tipped it: in a start-up phase or between two (issue 49's CI: 0.16 s
    unaccounted). It now scans only what was made since. DataLoader workers forked
    later no longer write to those objects' pages when they collect (copy on write). -> the number
    of objects frozen."""
    gc.freeze()
    return gc.get_freeze_count()


def host_memory(pid='self'):
    """Peak and current resident set size of a process (this one by default), bytes (Linux /proc;
    None elsewhere or when the process is gone)."""
    out = {'host_peak_rss_bytes': None, 'host_rss_bytes': None}
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                if line.startswith('VmHWM:'):
                    out['host_peak_rss_bytes'] = int(line.split()[1]) * 1024
                elif line.startswith('VmRSS:'):
                    out['host_rss_bytes'] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def git_sha():
    try:
        sha = subprocess.run(['git', '-C', ROOT, 'rev-parse', 'HEAD'], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(['git', '-C', ROOT, 'status', '--porcelain', '--untracked-files=no'],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (sha + ('-dirty' if dirty else '')) or None
    except (OSError, subprocess.SubprocessError):
        return None


def file_hash(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def usable_cores():
    """Cores this process may run on (its affinity mask: what Slurm's cgroup or taskset gives it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def intra_op_threads(num_workers, cpu_device, local_ranks=1, usable=None, node=None,
                     environ=os.environ):
    """torch's intra-op threads for this process, or None to leave them to OMP_NUM_THREADS when it
    is set. torch's default is every core of the affinity mask; ranks that share one mask (torchrun
    or mpirun without binding) would each take all of them, and on a GPU the main process, which
    mostly launches kernels, would compete with its own loader workers. On CPU the model is the work
    (the workers sleep once their prefetch queue is full), so it gets the process's share of the
    cores."""
    if read('OMP_NUM_THREADS', environ, None):
        return None
    usable = usable or usable_cores()
    node = node or os.cpu_count() or usable
    share = usable // local_ranks if local_ranks > 1 and usable >= node else usable
    return max(1, share if cpu_device else share - num_workers)


def host_check(num_workers, cpu_device, cores=usable_cores, load=os.getloadavg,
               threads=torch.get_num_threads,
               node_cores=os.cpu_count):
    """What a benchmark's figures depend on besides the flags: usable cores, the node's load before
    the run, torch's intra-op threads, the workers; with a sentence for each way they can spoil the
    timings."""
    usable, load1, t = cores(), load()[0], threads()
    main = t if cpu_device else 1  # on a GPU the main process needs about a core to launch kernels
    warnings = []
    if num_workers + main > usable:
        warnings.append(f'{num_workers} loader workers + {main} compute thread(s) exceed the '
                        f'{usable} usable cores: they will compete (lower --num-workers, or '
                        f'OMP_NUM_THREADS on CPU).')
    total = node_cores() or usable
    if load1 > 0.75 * total:
        warnings.append(f'this node was already busy before the run (load average {load1:.1f} on '
                        f'{total} cores): timings may be slower than on an idle node.')
    return {'usable_cores': usable, 'node_cores': total, 'load_avg_1m_before': load1,
            'torch_threads': t,
            'torch_threads_from': ('OMP_NUM_THREADS' if read('OMP_NUM_THREADS', default=None)
                                   else 'dlojz'),
            'num_workers': num_workers, 'warnings': warnings}


def provenance(device, dist):
    import torchvision
    prov = {
        'dlojz_sha': git_sha(), 'dlojz_py_sha256': file_hash(SCRIPT),
        'python': sys.version.split()[0], 'torch': torch.__version__,
        'torchvision': torchvision.__version__,
        'cuda': torch.version.cuda,
        'cudnn': torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        'nccl': None, 'host': socket.gethostname(), 'platform': platform.platform(),
        'cpu_count': usable_cores(), 'slurm_job_id': dist.job_id or None,
        'launcher': dist.launcher, 'device': str(device),
        'device_name': platform.processor() or 'cpu',
        'gpu_total_memory_bytes': None, 'driver': None,
        'time': datetime.datetime.now().isoformat(timespec='seconds'),
    }
    if device.type == 'cuda':
        p = torch.cuda.get_device_properties(device)
        prov.update(device_name=p.name, gpu_total_memory_bytes=p.total_memory,
                    compute_capability=f'{p.major}.{p.minor}')
        try:
            prov['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL absent from this build
            pass
        try:
            import pynvml
            pynvml.nvmlInit()
            prov['driver'] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # no NVML: driver left unknown
            pass
    return prov
