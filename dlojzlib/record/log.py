"""The run's records: the console (rank 0; tqdm on a terminal), the Logger (console lines,
metrics.jsonl, wandb) and JSON files written atomically; every file a run writes is opened through
open_for_write, and free space is read through disk_usage (the full-disk tests' seams)."""
import json
import netrc
import os
import shutil
import socket
import sys
import urllib.parse

import torch

from dlojzlib import files
from dlojzlib.errors import NO_SPACE, disk_full


SUMMARY_VERSION = 1


# The seams the full-disk tests drive: every file a run writes is opened by open_for_write, and the
# free space is read by disk_usage (bytes, shutil's named tuple).
open_for_write = open
disk_usage = shutil.disk_usage


def no_space(e):
    return isinstance(e, OSError) and e.errno in NO_SPACE


def write_json(path, obj):
    """Atomic (files.write_atomic): a failed write leaves the previous file and no temporary one; a
    full disk is DiskFull's sentence."""
    text = json.dumps(obj, indent=2, default=_json_default) + '\n'
    files.write_atomic(path, text, opener=open_for_write, full=lambda p: disk_full(p, disk_usage))


def _json_default(o):
    if isinstance(o, (torch.device, torch.dtype)):
        return str(o)
    if hasattr(o, 'item'):
        return o.item()
    return repr(o)


def wandb_mode(requested, environ=os.environ, connect=socket.create_connection, timeout_s=3.0):
    """--wandb online needs an API key and the network, which compute nodes often lack (Jean Zay's
    have no internet): without them wandb.init waits or fails after the run is built. Then the run
    logs offline, which `wandb sync` uploads later, rather than stop: logging must not cost the
    training. -> (mode used, None or the warning sentence). Facts are arguments, so that each case
    is tested without a network."""
    if requested != 'online':
        return requested, None
    url = urllib.parse.urlparse(environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai')
    host, port = url.hostname or 'api.wandb.ai', url.port or (80 if url.scheme == 'http' else 443)
    why = None
    if not environ.get('WANDB_API_KEY'):
        try:
            found = netrc.netrc(environ.get('NETRC') or None).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            found = None
        why = None if found else f'no API key for {host} (WANDB_API_KEY, or `wandb login` on a node with network)'
    if why is None:
        try:
            connect((host, port), timeout=timeout_s).close()
        except OSError as e:
            why = f'{host}:{port} cannot be reached from this node ({e.strerror or type(e).__name__})'
    if why is None:
        return 'online', None
    return 'offline', (f'--wandb online: {why}; logging offline instead, into <output-dir>/wandb: '
                       f'upload it with `wandb sync` from a node that has the network.')


class Console:
    """print() on rank 0 only. On a terminal it goes through tqdm, so that a progress bar is not
    torn, and bar() draws one; elsewhere (batch jobs, pipes, tests) tqdm is not even imported."""

    def __init__(self, enabled=True, tty=None):
        self.enabled = enabled
        self.tty = enabled and (sys.stdout.isatty() if tty is None else tty)

    def __call__(self, msg):
        if not self.enabled:
            return
        if self.tty:
            from tqdm import tqdm
            tqdm.write(str(msg))
        else:
            print(msg)
        sys.stdout.flush()

    def bar(self, total, desc):
        if not self.tty:
            return _NoBar()
        from tqdm import tqdm
        return tqdm(total=total, leave=False, desc=desc)


class _NoBar:
    def update(self, n=1):
        return None

    def close(self):
        return None


class Logger:
    """One record, emitted once, to three places on rank 0: a console line, metrics.jsonl (one JSON
    object per line, flushed per line so that a crashed run keeps what it logged) and wandb.

    lines: record type -> function(record) -> console text (types without one are not printed);
    wandb: a wandb run or None; it gets the record's numbers as '<type>/<key>' at step global_step.
    """
    NOT_METRICS = {'type', 'epoch', 'step', 'global_step'}

    def __init__(self, path, console, append=False, lines=None, wandb=None):
        # A resumed run continues its log; a fresh run in a reused folder starts a new one.
        self.console = console
        self.path = path
        try:
            # unbuffered bytes: a record a full disk refuses is cut off whole (log), never left
            # half-written
            mode = 'ab' if append else 'wb'
            self.f = open_for_write(path, mode, buffering=0) if console.enabled else None
        except OSError as e:
            if no_space(e):
                raise disk_full(path, disk_usage) from None
            raise
        self.lines = lines or {}
        self.wandb = wandb

    def print(self, msg):
        self.console(msg)

    def bar(self, total, desc):
        return self.console.bar(total, desc)

    def log(self, **record):
        if self.f is None:
            return
        line = memoryview((json.dumps(record, default=_json_default) + '\n').encode())
        end = self.f.tell()
        try:
            while line:  # a raw write may be short
                line = line[self.f.write(line):]
        except OSError as e:
            try:  # the part of the line that was written goes: a resumed run appends after whole lines only
                self.f.truncate(end)
            except OSError:
                pass
            if no_space(e):
                raise disk_full(self.path, disk_usage) from None
            raise
        line = self.lines.get(record['type'])
        if line:
            self.console(line(record))
        if self.wandb is not None:
            numbers = {f"{record['type']}/{k}": v for k, v in record.items()
                       if k not in self.NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numbers:
                self.wandb.log(numbers, step=record.get('global_step'))

    def size(self):
        """Bytes of metrics.jsonl written so far (each record is flushed), None off rank 0: a
        checkpoint keeps it, so that a run resumed from it drops the records of the steps after it
        (trim_metrics)."""
        return os.fstat(self.f.fileno()).st_size if self.f is not None else None

    def close(self, exit_code=0):
        """Idempotent: every exit path calls it."""
        if self.f is not None:
            f, self.f = self.f, None
            try:
                f.close()
            except OSError:  # the flush of a line a full disk refused: that error was reported already
                pass
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None


def console_lines(args, steps_per_epoch):
    """How each record type reads on the console; metrics.jsonl and wandb get the record itself."""
    return {
        'train': lambda r: (f"epoch {r['epoch']}/{args.epochs} step {r['step']}/{steps_per_epoch} "
                            f"loss {r['loss']:.4f} lr {r['lr']:.5f} | step {r['step_ms']:.1f} ms "
                            f"data {r['data_ms']:.1f} ms | {r['img_s']:.1f} img/s | mem "
                            f"{r['mem_bytes'] / 2**30:.2f} GiB"),
        'train_metrics': lambda r: (f"Train metrics at step {r['step']}: loss {r['loss']:.4f} "
                                    f"top-1 {r['top1']:.4f} top-5 {r['top5']:.4f}"),
        'val': lambda r: (f"Validation epoch {r['epoch']}: loss {r['loss']:.4f} top-1 "
                          f"{r['top1']:.4f} top-5 {r['top5']:.4f} ({r['images']} images, "
                          f"{r['time_s']:.1f} s)"),
        'val_ema': lambda r: (f"Validation (EMA) epoch {r['epoch']}: loss {r['loss']:.4f} top-1 "
                              f"{r['top1']:.4f} top-5 {r['top5']:.4f}"),
        'findlr': lambda r: (f"LR sweep step {r['global_step']}: lr {r['lr']:.3g} loss "
                             f"{r['loss']:.4f} (smoothed {r['smoothed']:.4f})"),
    }


def build_wandb(args, dist):
    """Rank 0's wandb run under --wandb offline or online (imported only then), else None."""
    if args.wandb == 'off' or not dist.is_main:
        return None
    args.wandb, warning = wandb_mode(args.wandb)  # what config.json records: the mode used
    if warning:
        print(f'Warning: {warning}', flush=True)
    import wandb  # seconds to import: only when asked for
    return wandb.init(project='dlojz', name=os.path.basename(args.output_dir), mode=args.wandb,
                      dir=args.output_dir, config=vars(args))
