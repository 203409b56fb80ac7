"""The environment variables dlojz reads, each with one parser: the DLOJZ_* variables with the
form of their value, the launchers' (torchrun's, srun's SLURM_*) and OpenMP's (read: a value, or
one sentence naming the variable and its value), the failpoints of DLOJZ_FAULT; and the check that
refuses an unknown DLOJZ_* variable or a value dlojz does not understand (flags.check_flags runs
it). Light: no torch at import."""
import itertools
import math
import os
import re
import signal

from dlojzlib.errors import UsageError


# The DLOJZ_* variables: what dlojz.py reads, and what its scripts and tests set. A name not here is
# a misspelling (DLOJZ_DATADIR) that would change nothing: refused.
ENVIRONMENT = {
    'DLOJZ_DATA_DIR': None,  # a folder (data.datasets.resolve_data_source checks it)
    'DLOJZ_HANDOVER': (r'default', 'default'),  # torch's own collate instead of the shared slots
    # 0: nvImageCodec unused: --decode fast decodes whole files, --decode gpu with torchvision's nvJPEG
    'DLOJZ_REGION_DECODE': (r'[01]', '0 or 1'),
    # appended to the first node's name (srun): the name of its high-speed interface
    'DLOJZ_MASTER_SUFFIX': (r'[A-Za-z0-9._-]*', 'a host-name suffix such as -ib0'),
    'DLOJZ_FAULT': None,  # the crash tests' failpoints (faults() checks it)
    # 1: a CPU run makes the choices of a CUDA run wherever torch runs them on a CPU (the tests'
    # seam: dlojzlib.choices)
    'DLOJZ_AS_IF_CUDA': (r'[01]', '0 or 1'),
    'DLOJZ_RUN': None, 'DLOJZ_VENV': None,  # the slurm/ scripts' (the run name, the environment)
    'DLOJZ_REQUIRE_GPU': None, 'DLOJZ_SLURM_SETUP': None, 'DLOJZ_STUB_LOG': None,  # the tests'
    'DLOJZ_GPU_PROGRESS': None,  # tests/gpu/run.sh's progress file (tests/gpu/progress.py)
}


def check_environment(environ=os.environ):
    """Refuse a DLOJZ_* variable dlojz does not know, or a value it does not understand, naming the
    variable (one sentence; it would otherwise be ignored)."""
    read('OMP_NUM_THREADS', environ, None)  # OpenMP ignores a bad value, silently
    for name in sorted(environ):
        if not name.startswith('DLOJZ_'):
            continue
        if name not in ENVIRONMENT:
            raise UsageError(f'{name} is set, but dlojz reads no such variable (it reads '
                             f'{", ".join(list(ENVIRONMENT)[:5])}); unset it, or correct its name.')
        form, value = ENVIRONMENT[name], environ[name]
        if form is not None and value and not re.fullmatch(form[0], value):
            raise UsageError(f'{name}={value!r} is not a value dlojz understands (it takes '
                             f'{form[1]}); correct it, or unset it.')
    faults(environ)  # here rather than at failpoints' import: one sentence, not a traceback


def as_if_cuda(environ=os.environ):
    """Whether DLOJZ_AS_IF_CUDA=1 asks a CPU run to make a CUDA run's choices (dlojzlib.choices);
    a value other than 0 or 1 is refused by check_environment at start-up, and reads as 0 here."""
    return environ.get('DLOJZ_AS_IF_CUDA', '') == '1'


# ------------------------------------------------------------------------ the launchers' variables

# A node list or a tasks-per-node list longer than this is refused, not expanded: ten times the
# nodes of the largest clusters Slurm runs (Frontier: 9 408, Aurora: 10 624), and short of what
# 'n[0-999999999]' would take of the memory and the time.
MAX_HOSTS = 100_000
# Counts and indices (ranks, tasks, CPUs, MiB): what a C int holds, as in Slurm's and torch's code
MAX_INT = 2**31 - 1
# OpenMP starts as many threads as asked, a bad value included
MAX_THREADS = 100_000


def integer(low, high=MAX_INT, form=None):
    """A parser of the whole numbers from low to high, in decimal digits as the launchers write
    them (int() would take ' 7', '1_0' and other scripts' digits)."""
    def parse(text):
        if re.fullmatch(r'[0-9]{1,10}', text) and low <= int(text) <= high:
            return int(text)
        raise ValueError(form or f'an integer from {low} to {high}')
    return parse


def job_id(text):
    """Slurm's job id, as text (it names the run folder): digits only."""
    if re.fullmatch(r'[0-9]{1,18}', text):
        return text
    raise ValueError('a Slurm job id (digits)')


def host(text):
    """A host name or an IP address (MASTER_ADDR)."""
    if re.fullmatch(r'[A-Za-z0-9._:%-]{1,255}', text):
        return text
    raise ValueError('a host name or an IP address')


def threads(text):
    """OMP_NUM_THREADS -> the threads of its first level ('4', or '4,2' for nested levels)."""
    m = re.fullmatch(r'([0-9]{1,9})(?:,[0-9]{1,9})*', text)
    if m and 1 <= int(m[1]) <= MAX_THREADS:
        return int(m[1])
    raise ValueError(f'a number of threads (a positive integer up to {MAX_THREADS}, or a list '
                     f'such as 4,2 for nested levels)')


_NAME = r'(?:[A-Za-z0-9._-]|\[[^\[\]]*\])+'  # a host name, or several with brackets in it


def expand_nodelist(text):
    """Slurm's host list -> the host names: 'jz[001-003,010],gpu7' -> ('jz001', 'jz002', 'jz003',
    'jz010', 'gpu7'), brackets anywhere in a name ('r[1-2]n[01-04]', 'n[1-4]-ib'); '' -> ().
    Counted before it is expanded: past MAX_HOSTS names, refused."""
    form = 'a Slurm node list such as jz[001-003,010],gpu7'
    if not re.fullmatch(rf'(?:{_NAME}(?:,{_NAME})*)?', text):
        raise ValueError(form)
    hosts = []
    for name in re.findall(_NAME, text):
        pieces = []  # per piece of the name: [(numbers, width to pad them to)], or its text
        for inside, plain in re.findall(r'\[([^\[\]]*)\]|([^\[]+)', name):
            pieces.append(plain or _spans(inside, form))
        count = math.prod(1 if isinstance(p, str) else sum(len(r) for r, _ in p) for p in pieces)
        if len(hosts) + count > MAX_HOSTS:
            raise ValueError(_too_many(form, len(hosts) + count))
        texts = [[p] if isinstance(p, str) else [f'{i:0{w}d}' for r, w in p for i in r]
                 for p in pieces]
        hosts += [''.join(t) for t in itertools.product(*texts)]
    return tuple(hosts)


def _spans(inside, form):
    """'001-003,010' -> [(range(1, 4), 3), (range(10, 11), 3)]: the numbers in a pair of brackets,
    each with the width Slurm pads it to (its first number's)."""
    spans = []
    for part in inside.split(','):
        m = re.fullmatch(r'([0-9]{1,18})(?:-([0-9]{1,18}))?', part)
        if not m or int(m[2] or m[1]) < int(m[1]):
            raise ValueError(f'{form} ([{inside}] holds no range of numbers such as 001-003)')
        spans.append((range(int(m[1]), int(m[2] or m[1]) + 1), len(m[1])))
    return spans


def _too_many(form, count):
    return (f'{form} of at most {MAX_HOSTS} nodes (this one names {count} or more, which no '
            f'cluster has)')


def expand_tasks_per_node(text):
    """Slurm's tasks-per-node list -> the tasks of each node: '4(x2),3' -> [4, 4, 3]; past
    MAX_HOSTS nodes, refused before it is expanded."""
    form = 'a Slurm tasks-per-node list such as 4(x2),3'
    counts = []
    for part in text.split(','):
        m = re.fullmatch(r'\s*([0-9]{1,9})(?:\(x([0-9]{1,9})\))?\s*', part)
        if not m:
            raise ValueError(form)
        if int(m[1]) < 1 or int(m[2] or 1) < 1:
            raise ValueError(f'{form} (each node runs at least one task)')
        if len(counts) + int(m[2] or 1) > MAX_HOSTS:
            raise ValueError(_too_many(form, len(counts) + int(m[2] or 1)))
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


_SLURM = ('Slurm sets it itself: unset it, or run dlojz with srun inside an sbatch/salloc '
          'allocation')
_TORCHRUN = 'torchrun sets it itself: launch dlojz with torchrun, without setting it'
# The variables of the launchers (and OpenMP's) that dlojz reads: name -> (its parser, what to do)
PARSERS = {
    **dict.fromkeys(('RANK', 'LOCAL_RANK'), (integer(0), _TORCHRUN)),
    **dict.fromkeys(('WORLD_SIZE', 'LOCAL_WORLD_SIZE'), (integer(1), _TORCHRUN)),
    'MASTER_ADDR': (host, _TORCHRUN),
    'MASTER_PORT': (integer(1, 65535, 'a port number (1-65535)'),
                    'unset it to let dlojz derive one from the job id, or export a free port'),
    **dict.fromkeys(('SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_NODEID', 'SLURM_RESTART_COUNT',
                     'SLURM_MEM_PER_NODE', 'SLURM_MEM_PER_CPU'), (integer(0), _SLURM)),  # MiB
    **dict.fromkeys(('SLURM_NTASKS', 'SLURM_STEP_NUM_TASKS', 'SLURM_NNODES', 'SLURM_CPUS_PER_TASK',
                     'SLURM_CPUS_ON_NODE'), (integer(1), _SLURM)),
    **dict.fromkeys(('SLURM_JOB_ID', 'SLURM_JOBID'), (job_id, _SLURM)),
    **dict.fromkeys(('SLURM_JOB_NODELIST', 'SLURM_STEP_NODELIST'), (expand_nodelist, _SLURM)),
    **dict.fromkeys(('SLURM_TASKS_PER_NODE', 'SLURM_STEP_TASKS_PER_NODE', 'SLURM_NTASKS_PER_NODE'),
                    (expand_tasks_per_node, _SLURM)),
    'OMP_NUM_THREADS': (threads, 'give a positive integer, or unset it (dlojz then gives each '
                                 'process its share of the cores)'),
}
REQUIRED = object()


def read(name, environ=os.environ, default=REQUIRED):
    """The value of the variable `name` (a row of PARSERS), `default` when it is unset or empty,
    or a UsageError: one sentence naming the variable and its value, and what to do."""
    text = environ.get(name, '')
    if text == '' and default is not REQUIRED:
        return default
    parse, todo = PARSERS[name]
    try:
        return parse(text)
    except ValueError as e:
        raise UsageError(f'{name}={shown(text)} is not {e}; {todo}.') from None


def shown(text, most=60):
    """repr(text), cut to `most` characters: a sentence stays one line of reasonable length."""
    return repr(text) if len(text) <= most else f'{text[:most]!r}...'


# ---------------------------------------------------------------------------- the failpoints

# DLOJZ_FAULT's failpoints (failpoints.py says what each injects): name -> the form of its argument
FAILPOINTS = {'kill-in-checkpoint': r'\d+', 'no-flock': r'', 'slow-steps': r'\d+(\.\d*)?',
              'signal-step': r'\d+:SIG[A-Z0-9]+', 'signal-val': r'\d+:SIG[A-Z0-9]+',
              'slow-loader': r'\d+:\d+(\.\d*)?', 'slow-worker-start': r'\d+(\.\d*)?',
              'kill-generator': r'\d+', 'slow-phase': r'\d+:[a-z_]+:\d+(\.\d*)?'}


def fault_points(text, restart_count=0):
    """DLOJZ_FAULT's text -> {name: argument ('' for a bare name)}. An unknown name is refused: a
    misspelt failpoint would inject nothing and let a crash test pass without its crash."""
    armed = {}
    for entry in filter(None, (e.strip() for e in (text or '').split(','))):
        name, _, arg = entry.partition(':')
        if name not in FAILPOINTS:
            raise ValueError(f'DLOJZ_FAULT names an unknown failpoint {shown(name)}; known: '
                             f'{", ".join(FAILPOINTS)}.')
        if not re.fullmatch(FAILPOINTS[name], arg, re.ASCII) or (
                name.startswith('signal-') and not hasattr(signal, arg.split(':')[1])):
            raise ValueError(f'DLOJZ_FAULT: failpoint {name} takes an argument of the form '
                             f'{FAILPOINTS[name]!r} (got {shown(arg)}); see '
                             f'dlojzlib/failpoints.py.')
        armed[name] = arg
    if restart_count:  # the slowness is for the attempt Slurm stops; the requeued one runs at speed
        armed.pop('slow-steps', None)
        armed.pop('slow-phase', None)
    return armed


def faults(environ=os.environ):
    """The failpoints DLOJZ_FAULT arms in this attempt (a requeued one's, SLURM_RESTART_COUNT >= 1,
    without its slow steps and slow phase), or one sentence (UsageError)."""
    restart = read('SLURM_RESTART_COUNT', environ, 0)
    try:
        return fault_points(environ.get('DLOJZ_FAULT'), restart)
    except ValueError as e:
        raise UsageError(str(e)) from None
