"""The slurm/ batch scripts and a submit helper, from one source (in the spirit of the course's
gpu_jobs_submitter).

    python dlojz_slurm.py --machine a100 --gpus 16 --dry-run -- --amp bf16 -b 256   # print the script
    python dlojz_slurm.py --machine a100 --gpus 16 --account abc@a100 --qos qos_gpu_a100-dev -- --amp bf16
                                                                                    # sbatch it, print the id
    python dlojz_slurm.py --write                                                   # regenerate slurm/*.slurm

Scripts are run from the repository root (`sbatch slurm/<script> [dlojz flags]`); the flags after the
script name are forwarded to dlojz.py and win over the script's own.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

from dlojzlib import ROOT
from dlojzlib.dist.machines import MACHINES, PARTITIONS

# (machine, GPUs, ranks per GPU) of the scripts in slurm/: one GPU, one full node, two nodes per site; the MPS
# script of the Alliance Canada guide (4 ranks on one GPU).
SHIPPED = [(m, g, 1) for m in ('v100', 'a100', 'h100', 'narval', 'booster')
           for g in (1, MACHINES[m]['gpus_per_node'], 2 * MACHINES[m]['gpus_per_node'])] + \
    [('narval', 1, 4), ('generic', 4, 1), ('cpu', 0, 1)]
PREFIX = {'jz': 'jz-', 'ac': 'ac-', 'jsc': 'jsc-'}
# Runs with their own flags, as scripts of their own. The course's fourth day trains CoAtNet-7
# (2.43 B parameters), which does not fit one GPU's memory with its AdamW state: ZeRO-3 on Jean
# Zay's H100s. 'plan': the model states per GPU (GB, fp32, AdamW) that dlojz prints before the first
# step, per mode at each size (tests/test_slurm_scripts.py computes them again from the model).
RECIPES = {
    'coatnet7': {
        'what': "the course's fourth day, CoAtNet-7 (2.43 B parameters) with ZeRO-3 "
                "(docs/sharding.md)",
        'flags': ['--arch coatnet7', '--shard full', '--optimizer adamw', '--amp bf16', '-b 32'],
        'plan': {4: {'none': 38.9, 'optimizer': 24.3, 'gradients': 9.7, 'full': 9.7},
                 8: {'none': 38.9, 'optimizer': 21.9, 'gradients': 4.9, 'full': 4.9}},
    },
}
RECIPES['lightning'] = {  # a script of its own: the JSC course's, measured by dlojzlib.lightning
    'what': "the JSC course's Lightning ResNet-50, timed by dlojz's callback (docs/lightning.md)",
    'program': 'examples/lightning_resnet50.py', 'flags': [], 'plan': None}
SHIPPED_RECIPES = [('h100', 4, 'coatnet7'), ('h100', 8, 'coatnet7')]
SHIPPED_PROGRAMS = [('booster', 1, 'lightning'), ('booster', 4, 'lightning')]


def spec(machine, partition=None):
    """The node shape, with a partition's own shape where it has one (Jean Zay's gpu_p2)."""
    return {**MACHINES[machine], **PARTITIONS.get((machine, partition), {})}


def script_name(machine, gpus, ranks_per_gpu=1, partition=None, recipe=None):
    if machine == 'cpu':
        return 'cpu.slurm'
    prefix = PREFIX.get(MACHINES[machine]['site'], '')
    part = f'-{partition}' if (machine, partition) in PARTITIONS else ''
    mps = f'-mps{ranks_per_gpu}' if ranks_per_gpu > 1 else ''
    return f'{prefix}{machine}{part}-{gpus}gpu{mps}{"-" + recipe if recipe else ""}.slurm'


def recipe_lines(recipe, gpus):
    """A recipe's comment block: what it runs and the plan at this size."""
    r = RECIPES[recipe]
    if r['plan'] is None:
        return [f'# This run: {r["what"]}.']
    plan = ', '.join(f'--shard {mode} {gb:g}' for mode, gb in r['plan'][gpus].items())
    return [f'# This run: {r["what"]}.',
            f'# Model states per GPU planned at {gpus} GPUs, GB (parameters, gradients and AdamW '
            'state in fp32, as',
            '# dlojz prints them before the first step; the sharded modes gather parameters during '
            'the step on',
            f'# top): {plan}.']


def shape(machine, gpus, partition=None):
    """-> (nodes, GPUs per node): whole nodes beyond one node."""
    m = spec(machine, partition)
    cap = m['gpus_per_node']
    if machine == 'cpu':
        return 1, 1
    if gpus < 1:
        raise ValueError(f'--gpus {gpus}: ask for at least 1 GPU (--machine cpu runs without any).')
    if gpus > cap and gpus % cap:
        raise ValueError(f'{gpus} GPUs on {machine} nodes of {cap} GPUs: ask for at most {cap}, or a multiple of it.')
    if m.get('gpus_allowed') and gpus != 1 and gpus % cap:
        raise ValueError(f'{gpus} GPUs on {m["title"]}: the site allows {m["gpus_allowed"]} GPUs per job.')
    return max(1, gpus // cap), min(gpus, cap)


def command(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None,
            ranks_per_gpu=1, recipe=None):
    """The dlojz_slurm.py command that renders this script."""
    extra = [f'--{k} {v}' for k, v in (('account', account), ('qos', qos), ('partition', partition),
                                       ('ranks-per-gpu', ranks_per_gpu if ranks_per_gpu > 1
                                        else None),
                                       ('recipe', recipe)) if v]
    return ' '.join(['python dlojz_slurm.py --machine', machine, '--gpus', str(gpus), '--time', time_limit, *extra,
                     '--dry-run'])


def sbatch_options(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None,
                   ranks_per_gpu=1, recipe=None):
    """-> [(option, why)]; an option starting with '#' is printed commented out (##SBATCH)."""
    m = spec(machine, partition)
    nodes, per_node = shape(machine, gpus, partition)
    # also the run's name
    name = script_name(machine, gpus, ranks_per_gpu, partition, recipe)[:-len('.slurm')]
    tasks = nodes * per_node * ranks_per_gpu
    opts = [(f'--job-name=dlojz-{name}', 'name in squeue and in the log file names'),
            (f'--output=slurm/log/%x_%j_{nodes}nodes_{tasks}tasks.out', '%x job name, %j job id'),
            (f'--error=slurm/log/%x_%j_{nodes}nodes_{tasks}tasks.err', 'stderr, same name'),
            ('--open-mode=append', 'a requeued job appends to the same logs'),
            (f'--nodes={nodes}', 'nodes'),
            (f'--ntasks-per-node={per_node * ranks_per_gpu}', f'{ranks_per_gpu} tasks per GPU, sharing it through '
             'MPS' if ranks_per_gpu > 1 else 'one task per GPU: each task drives one GPU')]
    if machine != 'cpu' and m.get('gpu_type'):
        opts.append((f'--gpus-per-node={m["gpu_type"]}:{per_node}', 'GPUs per node, with the model the site asks '
                     'for'))
    elif machine != 'cpu':
        opts.append((f'--gres=gpu:{per_node}', 'GPUs per node'))
    cpus = m['cpus_per_task'] // ranks_per_gpu
    opts.append((f'--cpus-per-task={cpus}', f'{"hardware threads" if m.get("threads") else "cores"} per task: dlojz '
                 'uses them as DataLoader workers' + (f' ({m["cpus_per_task"]} per GPU, shared)'
                                                       if ranks_per_gpu > 1 else '')))
    if m.get('mem_per_gpu'):
        opts.append((f'--mem={m["mem_per_gpu"] * per_node}G', f'memory per node: the site\'s {m["mem_per_gpu"]} GB '
                     'per GPU (its default is 256 MB per core)'))
    elif m.get('mem'):
        opts.append((f'--mem={m["mem"]}', m.get('mem_note', 'all of the node\'s memory')))
    if m['site'] in ('jz', 'generic', 'cpu'):  # as IDRIS's templates do; the others' documentation does not
        opts.append(('--hint=nomultithread', 'physical cores only, no hyperthreads'))
    opts.append((f'--time={time_limit}', 'ADAPT: wall-time limit (requeue continues longer runs)'))
    if m.get('constraint'):
        opts.append((f'--constraint={m["constraint"]}', f'the {machine.upper()} partition'))
    if account:
        opts.append((f'--account={account}', 'the project the hours are charged to'))
    elif m['site'] == 'jz':
        opts.append((f'--account={m["account"]}', f'ADAPT: your project (idrproj), with the @{machine} suffix'))
    elif m['site'] == 'jsc':
        opts.append((f'--account={m["account"]}', 'ADAPT: your compute project (jutil user projects)'))
    elif m.get('account'):
        opts.append((f'#--account={m["account"]}', 'ADAPT: your allocation (def-<PI> or a RAC account)'))
    if qos:
        opts.append((f'--qos={qos}', 'quality of service'))
    elif m.get('qos_dev'):
        opts.append((f'#--qos={m["qos_dev"]}', f'ADAPT: uncomment for short development jobs on {machine.upper()}'))
    if partition:
        opts.append((f'--partition={partition}', 'partition'))
    elif m.get('partition'):
        opts.append((f'--partition={m["partition"]}', f'ADAPT: {m["partition_dev"]} for short tests'))
    elif m['site'] in ('generic', 'cpu'):
        opts.append((f'#--partition={"cpu" if machine == "cpu" else "gpu"}', 'ADAPT: your partition, if not the '
                     'default'))
    opts += [('--signal=USR2@120', 'SIGUSR2 120 s before the limit: dlojz checkpoints and requeues'),
             ('--requeue', 'allow that requeue (and requeue after preemption)')]
    return opts


def environment(m):
    """The lines that set up the software, as the site's documentation writes them."""
    if m['site'] == 'jz':  # IDRIS's templates: purge, the arch tree, leave any conda environment, the module
        L = ['module purge                              # ADAPT: the software environment']
        L += [f'module load {mod}  # A100/H100 nodes have their own module tree' for mod in m['modules']
              if mod.startswith('arch/')]
        L += ['conda deactivate 2> /dev/null             # a conda environment active at submission would hide '
              'the module\'s Python']
        L += [f'module load {mod}  # ADAPT: version (module avail pytorch-gpu; the list per arch tree could not be '
              f'confirmed from here)' for mod in m['modules']
              if not mod.startswith('arch/')]
        return L
    if m['site'] == 'ac':  # Alliance Canada's Python page: a virtualenv on each node's local disk, from the
        # site's wheelhouse (no internet on most compute nodes), one per node for a multi-node job
        return [f'module load {" ".join(m["modules"])}  # ADAPT: the Python version (module avail python)',
                '# A virtual environment on the local disk of every node, from the site\'s wheels; `avail_wheels -r',
                '# requirements.txt` on a login node lists them (dlojz runs without simplejpeg, slower: --decode pil).',
                '# The quoted EOF lets each node expand its own $SLURM_TMPDIR.',
                'srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 bash << \'EOF\'',
                'virtualenv --no-download "$SLURM_TMPDIR/env"',
                'source "$SLURM_TMPDIR/env/bin/activate"',
                'pip install --no-index --upgrade pip',
                'pip install --no-index -r requirements.txt',
                'EOF',
                'source "$SLURM_TMPDIR/env/bin/activate"']
    L = []
    if m['site'] == 'jsc':  # JSC's courses: a stage, then the toolchain and PyTorch modules
        L += [f'module load {m["modules"][0]}  # ADAPT: the software stage of the year',
              f'module load {" ".join(m["modules"][1:])}',
              '# ADAPT: a venv made on a login node on top of these modules (python -m venv --system-site-packages',
              '# .venv; pip install -r requirements.txt) for what the modules lack',
              '# ADAPT: no node-local disk on Booster nodes could be confirmed, so no --stage-dir here (JSC\'s courses',
              '# copy data to /dev/shm, which is memory)']
    L += ['source "${DLOJZ_VENV:-.venv}/bin/activate"  # ADAPT: the virtual environment with requirements.txt']
    if m.get('master_suffix'):
        L += [f'# the first node\'s InfiniBand name, <node>{m["master_suffix"]}, for the rendezvous (JSC\'s courses); '
              f'without it the', '# ranks meet over another network, or not at all',
              f'export DLOJZ_MASTER_SUFFIX=${{DLOJZ_MASTER_SUFFIX-{m["master_suffix"]}}}']
    return L


# Slurm's time formats (sbatch --time): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds
TIME_FORMAT = re.compile(r'(\d+-)?\d+(:\d{1,2}){0,2}')
# what an account, a QOS or a partition (a comma-separated list) is made of: a value written into
# the script must not end its line or start another
NAME_FORMAT = re.compile(r'[A-Za-z0-9_.@+-]+(,[A-Za-z0-9_.@+-]+)*')


def check_values(time_limit, account, qos, partition):
    """Refuse a value that is not of Slurm's form before it is written into a script."""
    if not TIME_FORMAT.fullmatch(time_limit):
        raise ValueError(f'--time {time_limit!r} is not a Slurm time limit; give HH:MM:SS, MM, '
                         f'MM:SS or D-HH[:MM[:SS]] (e.g. 02:00:00 or 1-12).')
    for flag, value in (('--account', account), ('--qos', qos), ('--partition', partition)):
        if value is not None and not NAME_FORMAT.fullmatch(value):
            raise ValueError(f'{flag} {value!r} is not a Slurm name; use letters, digits and '
                             f'_ . @ + - only (a comma between partitions).')


def render(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None,
           ranks_per_gpu=1, recipe=None):
    """The batch script. account/qos/partition: given, they are set; else the script shows where
    they go. recipe: a run of RECIPES, its flags before the user's."""
    check_values(time_limit, account, qos, partition)
    m = spec(machine, partition)
    nodes, per_node = shape(machine, gpus, partition)
    what = 'CPU only, one task' if machine == 'cpu' else \
        f'{gpus} GPU(s) = {nodes} node(s) x {per_node} GPU(s), ' + \
        (f'{ranks_per_gpu} tasks per GPU (MPS)' if ranks_per_gpu > 1 else 'one task per GPU')
    opts = sbatch_options(machine, gpus, time_limit, account, qos, partition, ranks_per_gpu, recipe)
    sources = m.get('sources', []) + (['ac-local'] if m.get('stage') else []) + \
        (['ac-mps'] if ranks_per_gpu > 1 else [])
    L = ['#!/bin/bash',
         f'# dlojz on {m["title"]}: {what}.',
         '# Submit from the repository root:  sbatch <this script> [dlojz flags, e.g. --test-nsteps 50]',
         '# Made by: ' + command(machine, gpus, time_limit, account, qos, partition, ranks_per_gpu,
                                 recipe),
         '# (the scripts of slurm/ come from `python dlojz_slurm.py --write`): change the generator, or the lines '
         'marked ADAPT.',
         f'# Sources: docs/slurm.md#sites ({", ".join(sources)})' if sources else None]
    L += recipe_lines(recipe, gpus) if recipe else []
    # a leading '#' in the option makes a commented-out '##SBATCH' line
    L += [(f'##SBATCH {o[1:]:<44}' if o.startswith('#') else f'#SBATCH {o:<45}') + f'# {c}' for o, c in opts]
    L = [line for line in L if line is not None]
    L.append('')
    L += environment(m)
    L += ['',
          '# srun >= 22.05 no longer passes --cpus-per-task on to its tasks: without this each task may get one',
          '# core for its DataLoader workers',
          'export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK']
    if ranks_per_gpu > 1:  # Alliance Canada's Hyper-Q / MPS page
        L += ['# NVIDIA MPS: the tasks share the GPU concurrently (dlojz sees the daemon\'s pipe and allows it)',
              'export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps',
              'export CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-log',
              'nvidia-cuda-mps-control -d']
    start = len(L)
    L += ['# The run folder, runs/<run name>, does not depend on the job id: resubmitting this script with the same',
          '# flags continues the run after scancel or a time limit without requeue (exit 5); once a run is over',
          '# the next one goes to <run name>.2. Choose the name with DLOJZ_RUN=<name> sbatch ..., or pass',
          '# --output-dir.',
          'RUN_NAME=${DLOJZ_RUN:-$SLURM_JOB_NAME${SLURM_ARRAY_TASK_ID:+-$SLURM_ARRAY_TASK_ID}-$(printf \'%s\\n\' "$@" | cksum | cut -d" " -f1)}',
          'case " $* " in *" --output-dir "* | *" --output-dir="*) RUN_NAME= ;; esac  # the folder is given',
          'set -x',
          'srun python -u dlojz.py \\',
          '    ${RUN_NAME:+--run-name "$RUN_NAME"} \\',
          '    --resume auto \\',
          '    --chkpt \\']
    program = RECIPES[recipe].get('program') if recipe else None
    if program:  # its own flags; Lightning requeues the job on SIGUSR2 (the script sets it)
        L[start:] = ['set -x', f'srun python -u {program} \\']
    if machine == 'cpu':
        L.append('    --device cpu \\')
    if m.get('stage'):
        # quoted: each task expands its own node's $SLURM_TMPDIR (dlojz reads the variable), not the batch shell
        L.append("    --stage-dir '$SLURM_TMPDIR' \\")  # shards are copied to the local disk; other data read in place
    L += [f'    {flag} \\' for flag in (RECIPES[recipe]['flags'] if recipe else [])]
    L += ['    "$@" &',
          'SRUN_PID=$!',
          '# A signal for this shell alone (scancel --batch --signal=USR2, #SBATCH --signal=B:USR2@120) is passed',
          '# on to srun, which forwards it to the tasks. SIGTERM is not: srun answers it by killing the tasks.',
          "trap 'kill -USR2 $SRUN_PID 2>/dev/null' USR2",
          'wait $SRUN_PID',
          'while kill -0 $SRUN_PID 2>/dev/null; do wait $SRUN_PID; done  # a trap ends a wait early',
          'wait $SRUN_PID; code=$?  # srun\'s status: bash keeps that of its last background job']
    if ranks_per_gpu > 1:
        L.append('echo quit | nvidia-cuda-mps-control  # stop the MPS daemon')
    L += ['exit $code', '']
    return '\n'.join(L)


def write_all(folder=os.path.join(ROOT, 'slurm')):
    os.makedirs(os.path.join(folder, 'log'), exist_ok=True)
    written = []
    for machine, gpus, ranks in SHIPPED:
        path = os.path.join(folder, script_name(machine, gpus, ranks))
        with open(path, 'w') as f:
            f.write(render(machine, gpus, ranks_per_gpu=ranks))
        written.append(path)
    for machine, gpus, recipe in SHIPPED_RECIPES + SHIPPED_PROGRAMS:
        path = os.path.join(folder, script_name(machine, gpus, recipe=recipe))
        with open(path, 'w') as f:
            f.write(render(machine, gpus, recipe=recipe))
        written.append(path)
    return written


def parse(argv):
    """Helper flags -> render()'s arguments (machine, gpus, time, account, qos, partition, ranks per GPU)."""
    a = parser().parse_args(argv)
    return a.machine, a.gpus, a.time, a.account, a.qos, a.partition, a.ranks_per_gpu, a.recipe


def parser():
    p = argparse.ArgumentParser(prog='dlojz_slurm.py', description=__doc__.split('\n\n')[0].replace('\n', ' '),
                                epilog=__doc__[__doc__.index('\n\n') + 2:], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--machine', choices=list(MACHINES), default='a100', help='node shape: ' + '; '.join(
        f"{k}: {m['title']}" for k, m in MACHINES.items()))
    p.add_argument('--gpus', type=int, default=1, help='GPUs in all (a multiple of the node size beyond one node)')
    p.add_argument('--time', default='02:00:00', help='wall-time limit, HH:MM:SS')
    p.add_argument('--account', help='project to charge (Jean Zay: <idrproj>@a100, @h100 or @v100)')
    p.add_argument('--qos', help='quality of service, e.g. qos_gpu_a100-dev for short A100 tests on Jean Zay')
    p.add_argument('--partition', help='partition, where the cluster needs one (Jean Zay V100: gpu_p2, gpu_p2s or '
                   'gpu_p2l select the 8-GPU nodes)')
    p.add_argument('--ranks-per-gpu', type=int, default=1, help='tasks sharing each GPU through NVIDIA MPS')
    sizes = '; '.join(f'{r}: {", ".join(f"{g} GPUs" for _, g, n in SHIPPED_RECIPES if n == r)}'
                      if RECIPES[r]['plan'] else f'{r}: any size'
                      for r in sorted(RECIPES))
    p.add_argument('--recipe', choices=sorted(RECIPES), help='a run with its own flags and their '
                   'plan in the script\'s comments (coatnet7: the course\'s fourth day, --shard '
                   'full; lightning: examples/lightning_resnet50.py, the JSC course\'s script); '
                   f'its size: {sizes}')
    p.add_argument('--dry-run', action='store_true', help='print the script instead of submitting it')
    p.add_argument('--write', action='store_true', help='regenerate the scripts of slurm/')
    p.add_argument('dlojz_flags', nargs=argparse.REMAINDER, help='flags for dlojz.py (after --)')
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.write:
        for path in write_all():
            print(path)
        return 0
    try:
        if args.ranks_per_gpu < 1 or args.ranks_per_gpu > 1 and args.machine == 'cpu':
            raise ValueError(f'--ranks-per-gpu {args.ranks_per_gpu}: give 1 or more, on a GPU machine.')
        if args.recipe and RECIPES[args.recipe]['plan'] and \
                args.gpus not in RECIPES[args.recipe]['plan']:
            raise ValueError(f'--recipe {args.recipe} is planned for '
                             f'{sorted(RECIPES[args.recipe]["plan"])} GPUs, not --gpus '
                             f'{args.gpus}; give one of those.')
        text = render(args.machine, args.gpus, args.time, args.account, args.qos, args.partition,
                      args.ranks_per_gpu, args.recipe)
    except ValueError as e:
        print(f'dlojz_slurm: error: {e}', file=sys.stderr)
        return 2
    flags = [f for f in args.dlojz_flags if f != '--']
    if args.dry_run:
        print(text, end='')
        print(f'# would run: sbatch <this script> {" ".join(flags)}')
        return 0
    os.makedirs(os.path.join(ROOT, 'slurm', 'log'), exist_ok=True)
    with tempfile.NamedTemporaryFile('w', suffix='.slurm', dir=os.path.join(ROOT, 'slurm'), delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run(['sbatch', '--parsable', f.name, *flags], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        print('dlojz_slurm: error: sbatch not found; run this on a SLURM login node, or use --dry-run.',
              file=sys.stderr)
        return 2
    finally:
        os.remove(f.name)  # sbatch has its own copy once submitted
    if r.returncode != 0:
        print(f'dlojz_slurm: error: sbatch refused the job: {r.stderr.strip()}', file=sys.stderr)
        return 2
    print(r.stdout.strip().split(';')[0])
    return 0


if __name__ == '__main__':
    sys.exit(main())
