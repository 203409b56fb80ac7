"""The one place that knows how dlojz was launched (torchrun, srun, or a plain single process) and
that talks to torch.distributed.

No other module reads RANK/WORLD_SIZE/SLURM_* variables; everything else receives a DistInfo and
uses the helpers below, which are no-ops in a single process."""
import ctypes
import datetime
import gc
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from dlojzlib.dist import objects, starting
from dlojzlib.environment import read  # the parser of each launcher's variable
from dlojzlib.errors import EARLY_SIGNALS, DlojzError, UsageError, first_line


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = '127.0.0.1'
    master_port: int = 29500
    nodes: tuple = ()
    launcher: str = 'single'  # 'torchrun', 'slurm' or 'single'
    job_id: str = ''          # SLURM job id when running under SLURM, else ''

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        """True when dlojz runs under a launcher: a process group and DDP are set up, even at world
        size 1, so that one GPU under srun/torchrun runs the same code (and NCCL) as 32."""
        return self.launcher != 'single'

    @property
    def num_nodes(self):
        return len(self.nodes) or max(1, self.world_size // max(1, self.local_world_size))


def launch_variables(environ=os.environ):
    """The names of the launcher's variables this module reads (SLURM_*, RANK and the like) that are
    set: a process that starts dlojz as a single process of its own (a test, a benchmark) removes
    them."""
    torchrun = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')
    return [k for k in environ if k.startswith('SLURM_') or k in torchrun]


def get_dist_info(environ=os.environ):
    job_id = read('SLURM_JOB_ID', environ, read('SLURM_JOBID', environ, ''))
    if 'RANK' in environ and 'WORLD_SIZE' in environ:
        rank, world = read('RANK', environ), read('WORLD_SIZE', environ)
        local_rank, lws = read('LOCAL_RANK', environ, 0), read('LOCAL_WORLD_SIZE', environ, world)
        if not (0 <= rank < world and 0 <= local_rank < lws):
            raise UsageError(f'the environment says RANK={rank} LOCAL_RANK={local_rank} for WORLD_SIZE={world} '
                             f'LOCAL_WORLD_SIZE={lws}, which is inconsistent; start dlojz with torchrun.')
        return DistInfo(rank=rank, local_rank=local_rank, world_size=world, local_world_size=lws,
                        master_addr=read('MASTER_ADDR', environ, '127.0.0.1'),
                        master_port=read('MASTER_PORT', environ, 29500),
                        launcher='torchrun', job_id=job_id)
    # Under srun every task has SLURM_STEP_ID; the batch script itself (python run without srun) is
    # a single process even when the allocation has several tasks.
    if 'SLURM_PROCID' in environ and 'SLURM_STEP_ID' in environ:
        ntasks = 'SLURM_STEP_NUM_TASKS' if 'SLURM_STEP_NUM_TASKS' in environ else 'SLURM_NTASKS'
        if ntasks not in environ:
            raise UsageError('srun did not set SLURM_NTASKS; launch dlojz with srun inside an allocation '
                             '(sbatch/salloc).')
        rank, world = read('SLURM_PROCID', environ), read(ntasks, environ)
        local_rank = read('SLURM_LOCALID', environ, 0)
        nodes = read('SLURM_STEP_NODELIST', environ, None)
        nodes = read('SLURM_JOB_NODELIST', environ, ()) if nodes is None else nodes
        if world > 1 and not nodes:
            raise UsageError('srun started several tasks but SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is empty, so '
                             'the rank-0 host is unknown; run dlojz with srun inside an sbatch/salloc allocation.')
        spec = next((k for k in ('SLURM_STEP_TASKS_PER_NODE', 'SLURM_TASKS_PER_NODE',
                                 'SLURM_NTASKS_PER_NODE') if environ.get(k)), None)
        per_node = read(spec, environ) if spec else [world]
        node_id = read('SLURM_NODEID', environ, 0)
        lws = per_node[node_id] if node_id < len(per_node) else per_node[-1]
        if not (0 <= rank < world and 0 <= local_rank < lws):
            raise UsageError(f'SLURM says task {rank} (local {local_rank}) of {world} with {lws} tasks on this node, '
                             f'which is inconsistent; launch dlojz with srun, one task per GPU.')
        port = srun_port(environ, job_id, world)
        return DistInfo(rank=rank, local_rank=local_rank, world_size=world, local_world_size=lws,
                        # a site's suffix picks the node's fast interface (JSC: <node>i, the
                        # InfiniBand name)
                        master_addr=nodes[0] + environ.get('DLOJZ_MASTER_SUFFIX', '') if nodes else '127.0.0.1',
                        master_port=port, nodes=nodes,
                        launcher='slurm', job_id=job_id)
    return DistInfo(job_id=job_id)


def srun_port(environ, job_id, world):
    """The port of rank 0's store under srun, which every task must compute alike.

    MASTER_PORT when the user sets one. One task: 0, a free port the system picks, since no other
    task has to find it. Several: 20000 + job id % 10000, so that two jobs sharing a node differ,
    and below Linux's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), where
    the kernel hands ports to outgoing connections (gloo's and NCCL's own, of any job on the node)
    at any time: a CI run lost a job to EADDRINUSE on 37142 while another job's gloo mesh connected.
    """
    if 'MASTER_PORT' in environ:
        return read('MASTER_PORT', environ)
    if world == 1:
        return 0
    return 20000 + int(job_id) % 10000 if job_id else 29500  # job_id: digits (environment.job_id)


# -------------------------------------------------------------------------------------------- process group

_CPU_GROUP = None  # gloo group for host-side objects and flags (output dir, timings, stop); made by setup()


def mps_active(environ=os.environ):
    """Whether an NVIDIA MPS daemon serves this job (its control pipe exists): then several
    processes may share a GPU concurrently, as the Alliance Canada guide does for small models."""
    pipes = environ.get('CUDA_MPS_PIPE_DIRECTORY', '/tmp/nvidia-mps')
    return os.path.exists(os.path.join(pipes, 'control'))


def cuda_device_for(dist, share=False):
    """The GPU this process drives: its local rank, or the only visible GPU when the launcher binds
    one GPU per task (srun --gpus-per-task / --gpu-bind sets CUDA_VISIBLE_DEVICES per task). More
    tasks than GPUs only with `share` (--share-gpu, or MPS running): local rank modulo the GPUs."""
    n = torch.cuda.device_count()
    if not dist.distributed or n == 1:
        return 0
    if dist.local_rank < n or share:
        return dist.local_rank % n
    raise UsageError(f'{dist.launcher} started {dist.local_world_size} tasks on {socket.gethostname()} but only {n} '
                     f'GPUs are visible; start one task per GPU (e.g. --ntasks-per-node={n} with --gres=gpu:{n}), '
                     f'or run NVIDIA MPS (or pass --share-gpu) to share GPUs between tasks.')


def pick_device(choice, dist, share=False):
    """--device -> the torch.device of this process; on a GPU, its CUDA device made current."""
    if choice == 'cuda' and not torch.cuda.is_available():
        raise UsageError('--device cuda was requested but PyTorch sees no CUDA GPU; use --device cpu or run on a '
                         'GPU node.')
    if choice == 'cpu' or not torch.cuda.is_available():
        return torch.device('cpu')
    torch.cuda.set_device(cuda_device_for(dist, share))  # before anything allocates on the default GPU
    return torch.device('cuda', torch.cuda.current_device())


def process_group_backend(device_type, device_count, local_world_size, share):
    """The backend of the data-parallel process group: NCCL on CUDA GPUs, gloo on CPU, and gloo on
    CUDA when this node's tasks must share GPUs (`share` and more tasks than visible GPUs).

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected", ncclInvalidUsage), MPS or not
    (NVIDIA/nccl#418), and does so inside DDP's constructor. gloo rather than a refusal: sharing a GPU is
    what --share-gpu and MPS are for (several small replicas per GPU, the Alliance Canada recipe), and gloo
    implements broadcast and all_reduce on CUDA tensors (torch.distributed's backend table, torch 1.x to
    2.x; it stages them through host memory), the two collectives DDP uses (parameter/buffer broadcast,
    gradient buckets) and all dlojz's device-side collectives use. The price is a device->host->device copy
    of the gradients per step, small for the models that share a GPU. One GPU per task (srun
    --gpus-per-task) also shows one GPU to each of several tasks: with `share` set, gloo then too (correct,
    slower); without it _check_distinct_gpus tells a real collision from a binding."""
    if device_type != 'cuda':
        return 'gloo'
    return 'gloo' if share and local_world_size > device_count else 'nccl'


def setup(dist, device, timeout_min=None, share_gpu=False, alone=False):
    """Join the process group (process_group_backend says which). Every rank must call it. alone: a
    process of its own that --shard needs a group for: one on an in-memory store (no port, no
    network), with its gloo group for host objects."""
    global _CPU_GROUP
    if not dist.distributed:
        if alone and not tdist.is_initialized():
            tdist.init_process_group('nccl' if device.type == 'cuda' else 'gloo',
                                     store=tdist.HashStore(), rank=0, world_size=1)
            _CPU_GROUP = tdist.new_group(backend='gloo')
        return
    if dist.launcher == 'slurm':  # env:// reads these; rank 0 opens the store on master_addr:master_port
        os.environ.update(MASTER_ADDR=dist.master_addr, MASTER_PORT=str(dist.master_port), RANK=str(dist.rank),
                          WORLD_SIZE=str(dist.world_size), LOCAL_RANK=str(dist.local_rank))
    else:  # RANK and WORLD_SIZE set by hand (torchrun sets all four): get_dist_info's defaults for the others
        os.environ.setdefault('MASTER_ADDR', dist.master_addr)
        os.environ.setdefault('MASTER_PORT', str(dist.master_port))
    gpus = torch.cuda.device_count() if device.type == 'cuda' else 0
    backend = process_group_backend(device.type, gpus, dist.local_world_size, share_gpu)
    if backend == 'gloo' and device.type == 'cuda' and dist.is_main:
        print(f'{dist.local_world_size} tasks per node share {gpus} visible GPU(s): gradients are all-reduced '
              f'with gloo through host memory (NCCL refuses two ranks on one GPU)', flush=True)
    kw = {'timeout': datetime.timedelta(minutes=timeout_min)} if timeout_min else {}
    try:
        with cpp_errors_held(os.environ.get('TORCH_DISTRIBUTED_DEBUG') != 'DETAIL'):
            tdist.init_process_group(backend, init_method='env://', rank=dist.rank, world_size=dist.world_size, **kw)
    except (RuntimeError, ValueError) as e:  # DistStoreError/DistNetworkError are RuntimeErrors
        other = 'export MASTER_PORT' if dist.launcher == 'slurm' else 'torchrun --master-port'
        raise UsageError(f'could not join the process group at {dist.master_addr}:{dist.master_port} '
                         f'({first_line(e)}); check that every task started, that this address reaches rank 0\'s '
                         f'node and that the port is free ({other} chooses another; '
                         f'--dist-timeout bounds this wait).') from None
    # NCCL collectives need GPU tensors; host-side objects go through a gloo group so that they
    # never touch the GPU (and never initialise NCCL before --nccl-debug's log is in place). Made on
    # CPU runs too, so that CPU tests exercise the structure GPU runs use; it gets --dist-timeout as
    # well (new_group's own default is 30 min, and every host-side collective of a GPU run waits in
    # it).
    _CPU_GROUP = tdist.new_group(backend='gloo', **kw)
    if device.type == 'cuda':
        _check_distinct_gpus(dist, device, share_gpu)


# torch's C++ log lines (c10's '[E1125 01:40:35.694 TCPStore.cpp:328] ...') and the frame dumps
# under them
CPP_LOG = re.compile(rb'^(\[[EWIF]\d{4} \d\d:\d\d:\d\d\.\d+ |Exception raised from |frame #\d+: '
                     rb'|<omitting python frames>|$)')


@contextmanager
def cpp_errors_held(hold=True):
    """Hold back what is written to stderr (fd 2) during the block: the TCPStore client logs each
    failed connection attempt with a C++ frame dump before the Python exception that says the same
    in one line. Given back as it was when the block succeeds; when it raises (its one line reaches
    the user in ours), given back without torch's C++ log lines, so that the rest (a warning,
    another thread's line) is not lost."""
    try:
        held = tempfile.TemporaryFile() if hold else None
    except OSError:  # nowhere to hold it (a full /tmp): the frames are shown
        held = None
    if held is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(held.fileno(), 2)
    ok = False
    try:
        yield
        ok = True
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        text = held.read()
        held.close()
        if not ok:
            text = b''.join(line for line in text.splitlines(keepends=True) if not CPP_LOG.match(line))
        if text:
            os.write(2, text)


def _check_distinct_gpus(dist, device, share=False):
    uuid = getattr(torch.cuda.get_device_properties(device), 'uuid', None)  # torch >= 2.5
    if uuid is None:  # torch 2.4: no device UUID to compare (the launcher's binding is trusted)
        return
    me = (socket.gethostname(), str(uuid))
    seen = {}
    for rank, key in enumerate(all_gather_object(me)):
        if key in seen and not share:
            raise UsageError(f'ranks {seen[key]} and {rank} share GPU {key[1]} on {key[0]}; start one task per GPU '
                             f'(as many tasks per node as --gres=gpu:N, with each task seeing its own GPU), or run NVIDIA MPS (or pass '
                             f'--share-gpu) to share it.')
        seen[key] = rank


def wrap_ddp(model, device, args, comm=None):
    """DistributedDataParallel with dlojz's DDP flags (--find-unused-parameters, --bucket-cap-mb,
    --static-graph, --gradient-as-bucket-view, --broadcast-buffers); `comm`, a measure.comm.CommTimer, times
    its gradient all-reduce (a communication hook doing what DDP's built-in one does)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    # PyTorch >= 2.15 renamed broadcast_buffers (same meaning: rank 0's buffers sent before every
    # forward)
    buffers = 'forward_sync_buffers' if 'forward_sync_buffers' in inspect.signature(ddp).parameters else \
        'broadcast_buffers'
    wrapped = ddp(model, device_ids=[device.index] if device.type == 'cuda' else None,
                  find_unused_parameters=args.find_unused_parameters, bucket_cap_mb=args.bucket_cap_mb,
                  static_graph=args.static_graph, gradient_as_bucket_view=args.gradient_as_bucket_view,
                  **{buffers: args.broadcast_buffers})
    if comm is not None:
        wrapped.register_comm_hook(None, comm.hook)
        if args.broadcast_buffers:
            comm.time_buffers(wrapped)
    return wrapped


abandoned = False  # set by cleanup(): the process must exit without tearing the NCCL group down


def cleanup(peer_failed=False, synchronize=False):
    """Leave the process group. After a peer died, NCCL's teardown (ncclCommAbort in
    destroy_process_group or in the group's destructor) can wait forever for it (pytorch#119250,
    #132696): the group is abandoned and the entry point exits at once with os._exit. gloo's
    teardown returns (tested with a killed rank). synchronize (a run that ended normally on every
    rank): meet at a barrier first, so that no rank tears its group down while a peer still talks to
    it. Then the groups are freed, their threads joined, before the interpreter's finalisation
    (below)."""
    global abandoned, _CPU_GROUP
    if not (tdist.is_available() and tdist.is_initialized()):
        return
    if peer_failed and tdist.get_backend() == 'nccl':
        abandoned = True
        return
    if synchronize:
        try:
            tdist.barrier(group=_CPU_GROUP)
        except Exception:  # a peer gone already: leave anyway
            pass
    try:
        tdist.destroy_process_group()
    except Exception:  # a failed group may refuse to close; the process is exiting anyway
        pass
    # destroy_process_group() leaves a group's threads running while Python still holds the group
    # (_CPU_GROUP here, the default group in DDP's reducer, a reference cycle): a rank of a 3-rank
    # CPU run had all 7 of gloo's threads (pt_gloo_runloop, gloo_tcp_loop) alive after it. They then
    # ended during the interpreter's finalisation, where a C++ thread that needs the GIL is stopped
    # by pthread_exit and libstdc++ aborts: `terminate called without an active exception`, SIGABRT
    # after a normal end (one gloo rank of 8 under tests/slurm, one of 3 in the long tier, on 2 busy
    # cores). Freed here, each group's destructor joins its threads while the interpreter is whole
    # (tests/test_dist checks that none is left).
    _CPU_GROUP = None
    gc.collect()
    objects.keep()  # what no work holds any more (their threads are joined) is let go


def all_gather_object(obj):
    if not (tdist.is_available() and tdist.is_initialized()):
        return [obj]
    return objects.gather(obj, _CPU_GROUP)


def grouped():
    """Whether this process is in a process group (a distributed run)."""
    return tdist.is_available() and tdist.is_initialized()


def broadcast_object(obj, src=0):
    if not (tdist.is_available() and tdist.is_initialized()):
        return obj
    return objects.broadcast(obj, src, _CPU_GROUP)


def on_ranks(fn, when=True):
    """Run fn on the ranks where `when` holds; every rank then learns whether it failed anywhere, so
    that a failure on one rank (an unwritable folder, a full disk) stops all of them instead of
    leaving the others waiting at the next collective. Returns fn's result where it ran, else None.
    """
    result, error = None, None
    try:
        if when:
            result = fn()
    except Exception as e:  # re-raised below on every rank, as a user error when it is one
        error = e
    if tdist.is_available() and tdist.is_initialized():
        failures = [m for m in all_gather_object(None if error is None else _user_message(error)) if m]
        if failures and error is None:
            raise UsageError(failures[0])
    if error is not None:
        raise error
    return result


def _user_message(e):
    return str(e) if isinstance(e, DlojzError) else \
        f'{type(e).__name__}: {first_line(e)}'


def all_reduce_(tensor, op='sum', group=None):
    """In-place all-reduce of a device tensor over every rank, or over `group`'s (no-op in a
    single process)."""
    if tdist.is_available() and tdist.is_initialized():
        objects.keep(tensor)  # objects.py: its last reference must not be a gloo worker's
        tdist.all_reduce(tensor, op=getattr(tdist.ReduceOp, op.upper()), group=group)
    return tensor


def broadcast_buffers_(module, src=0):
    """Give every rank rank `src`'s BatchNorm running statistics (they drift apart: each rank
    updates them with its own batches, DDP only re-broadcasts at the start of the next training
    forward). A pipeline's ranks hold different parts, and no BatchNorm: nothing to share."""
    if tdist.is_available() and tdist.is_initialized() and not getattr(module, 'piped', False):
        for b in module.buffers():
            tdist.broadcast(b, src=src)


# -------------------------------------------------------------------------------------------- SLURM

def slurm_cpus_per_task(environ=os.environ):
    """CPUs SLURM gave each task (None outside SLURM): the default --num-workers there."""
    return read('SLURM_CPUS_PER_TASK', environ, None)


class StopSignal:
    """Preemption and time limits. SLURM sends SIGUSR2 ahead of the end (#SBATCH --signal=USR2@120)
    and SIGTERM at the limit; once steps run the handler only sets a flag, because checkpointing
    inside a signal handler can deadlock (Lightning #21406), and the training loop asks agreed() at
    every step boundary. Before the first step it ends the command's start-up (dist.starting).

    SIGUSR2 rather than SIGUSR1: submitit moved off USR1 after it clashed with NCCL (submitit
    #1697)."""
    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self):
        self.received, self._old = None, {}
        self.interrupted, self.held = False, []  # Ctrl-C under way; the signals that came after it
        self._work = self._flag = None  # the all-reduce started at the previous step
        self.hold_interrupt = False

    def install(self, pending=(), hold_interrupt=False):
        """pending: names of the stop signals received before (dlojz.EARLY_SIGNALS), read after the
        handlers are in place so that none falls between the two. hold_interrupt: after an
        interrupt, Ctrl-C stays ignored once the handlers are restored (the command, whose process
        ends next); otherwise (a run inside another program: pytest, a notebook) the caller's
        handler comes back, so that its next Ctrl-C or time limit stops it."""
        self.hold_interrupt = hold_interrupt
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        if pending and self.received is None:
            self.received = pending[-1]
        global _received
        _received = self.received  # this run's, not an earlier in-process run's
        return self

    def _handler(self, signum, frame):
        global _received
        if self.interrupted:  # the interrupt's shutdown is under way: it writes the record
            self.held.append(signal.Signals(signum).name)
            return
        self.received = _received = signal.Signals(signum).name
        starting.stop_if_starting(self.received, frame)  # before the first step: raises (starting)

    def _interrupt(self, signum, frame):
        """Ctrl-C: the first interrupts the step, as Python's own handler does. One that comes once
        a stop or an interrupt is under way (pressed twice; the terminal's and `timeout`'s, both;
        during the checkpoint a stop signal asked for) is held, so that the shutdown ends with its
        record written: a second KeyboardInterrupt raised inside it left summary.json 'running'."""
        if self.interrupted or self.received is not None:
            self.held.append('SIGINT')
            return
        self.interrupted = True
        raise KeyboardInterrupt

    def restore(self):
        """The handlers as they were; after an interrupt with hold_interrupt, Ctrl-C stays held
        until the process ends (the process group's teardown follows), so that no traceback comes
        after the record."""
        hold = self.interrupted and self.hold_interrupt
        for s, old in self._old.items():
            signal.signal(s, signal.SIG_IGN if s == signal.SIGINT and hold else old)
        self._old = {}
        global _received
        _received = None  # the run is over: a loader made next in this process is not stopped

    def agreed(self):
        """True on every rank at the same step once one rank got a signal, so that no rank stops or
        checkpoints alone. A MAX all-reduce on the host (gloo, no GPU work waited for), started in
        the background at each step and read at the next: the ranks agree one step later instead of
        meeting at a barrier every step. Call settle() when the loop ends."""
        if not (tdist.is_available() and tdist.is_initialized()):
            return self.received is not None
        stop = self.settle()
        self._flag = torch.tensor([0 if self.received is None else 1])
        objects.keep(self._flag)
        self._work = tdist.all_reduce(self._flag, op=tdist.ReduceOp.MAX, group=_CPU_GROUP, async_op=True)
        return stop

    def settle(self):
        """Wait for the all-reduce in flight (every rank started it at the same step); -> its
        verdict. None in flight in a lone process (no step ran: its loader's start was stopped by
        the signal, data.workers): its own signal. With peers, a rank never stops alone."""
        starting.disarm()  # the loop takes the stop from here: a checkpoint may follow
        if self._work is None:
            alone = not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1
            return alone and self.received is not None
        self._work.wait()
        self._work = None
        return bool(self._flag.item())  # a CPU tensor: no device synchronisation


_received = None  # the stop signal of the current run, for the loader's worker start (data.datasets)


def stop_received():
    """The stop signal of this run so far: its handler's, or one recorded before the handler
    existed."""
    return _received or (EARLY_SIGNALS[-1] if EARLY_SIGNALS else None)


def requeue(dist, signal_name=None):
    """Put this SLURM job back in the queue (`scontrol requeue`); -> (done, why not).

    Only on SIGUSR2, the warning the scripts ask for (--signal=USR2@120). SIGTERM comes both from
    the time limit and from scancel, and the job state does not tell them apart while the signal is
    delivered (measured: a cancelled job got requeued); after SIGTERM dlojz checkpoints and the user
    resubmits."""
    if signal_name != 'SIGUSR2':
        return False, f'{signal_name} may be a cancellation'
    if dist.launcher != 'slurm' or not dist.job_id:
        return False, 'not running under srun'
    try:
        r = subprocess.run(['scontrol', 'requeue', dist.job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f'scontrol failed: {e}'
    return r.returncode == 0, r.stderr.strip() or r.stdout.strip()


# -------------------------------------------------------------------------------------------- --nccl-debug

def nccl_debug_env(environ=os.environ):
    """The course's comm_profiler settings; NCCL reads them when it creates its first communicator."""
    environ['NCCL_DEBUG'] = 'INFO'
    environ['NCCL_DEBUG_SUBSYS'] = 'INIT,COLL'


class StdoutTee:
    """Copy everything written to file descriptor 1 into a file as well, including C libraries'
    output (NCCL prints its INFO lines on stdout), in the order it was written, so that dlojz's step
    markers land between the collectives they delimit."""

    def __init__(self, path):
        sys.stdout.flush()
        try:  # line-buffer C stdio's stdout: through a pipe it would otherwise be block-buffered
            libc = ctypes.CDLL(None)
            libc.setvbuf(ctypes.c_void_p.in_dll(libc, 'stdout'), None, 1, 0)  # 1 = _IOLBF
            self._flush_c = lambda: libc.fflush(None)
        except (OSError, ValueError, AttributeError):
            self._flush_c = lambda: None
        self.log = open(path, 'ab', buffering=0)
        self.saved = os.dup(1)
        r, w = os.pipe()
        os.dup2(w, 1)
        os.close(w)
        self.thread = threading.Thread(target=self._pump, args=(r,), daemon=True)
        self.thread.start()

    def _pump(self, r):
        with os.fdopen(r, 'rb', buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                try:
                    os.write(self.saved, chunk)
                    self.log.write(chunk)
                except (OSError, ValueError):  # closed while a forked worker still held the pipe
                    return

    def close(self):
        sys.stdout.flush()
        self._flush_c()
        os.dup2(self.saved, 1)  # drops our write end; the pump ends when forked loader workers exit too
        self.thread.join(timeout=2)
        os.close(self.saved)
        self.log.close()
