"""The DLOJZ_* environment variables dlojz reads, each with the form of its value, and the check
that refuses an unknown one or a value it does not understand (flags.check_flags runs it). Light:
no torch at import."""
import os
import re

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
    'DLOJZ_FAULT': None,  # the crash tests' failpoints (failpoints.parse checks it)
    'DLOJZ_RUN': None, 'DLOJZ_VENV': None,  # the slurm/ scripts' (the run name, the environment)
    'DLOJZ_REQUIRE_GPU': None, 'DLOJZ_SLURM_SETUP': None, 'DLOJZ_STUB_LOG': None,  # the tests'
    'DLOJZ_GPU_PROGRESS': None,  # tests/gpu/run.sh's progress file (tests/gpu/progress.py)
}


def check_environment(environ=os.environ):
    """Refuse a DLOJZ_* variable dlojz does not know, or a value it does not understand, naming the
    variable (one sentence; it would otherwise be ignored)."""
    threads = environ.get('OMP_NUM_THREADS', '')
    # OpenMP ignores a bad value, silently
    if threads and not re.fullmatch(r'0*[1-9]\d*(,\d+)*', threads):
        raise UsageError(f'OMP_NUM_THREADS={threads!r} is not a number of threads; give a positive '
                         f'integer, or unset it (dlojz then gives each process its share of the '
                         f'cores).')
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
