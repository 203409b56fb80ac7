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
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# Where each value below comes from (the table in docs/slurm.md repeats them, and tests/test_slurm_scripts.py
# checks the two against each other). Alliance Canada's wiki pages were read in their source as of 2026-05;
# JSC's node facts from its system page, its job conventions from its courses.
SOURCES = {
    'idris-gpu': 'http://www.idris.fr/en/docs/jean-zay/slurm/slurm_partitions_gpu (partitions, -C, gpu_p2s/p2l)',
    'idris-templates': "IDRIS's batch templates (module purge, arch/*, conda deactivate, --cpus-per-task as 1/4 "
                       "or 1/8 of a node's cores), as quoted in ../shared/reference/course.md",
    'idris-disk': 'http://www.idris.fr/en/docs/jean-zay/environnement/espaces-disques ($JOBSCRATCH: identical to '
                  'SCRATCH, shared; $DSDIR)',
    'ac-narval': 'https://docs.alliancecan.ca/wiki/Narval/en (node shapes)',
    'ac-rorqual': 'https://docs.alliancecan.ca/wiki/Rorqual/en (node shapes)',
    'ac-fir': 'https://docs.alliancecan.ca/wiki/Fir (node shapes)',
    'ac-nibi': 'https://docs.alliancecan.ca/wiki/Nibi (node shapes)',
    'ac-trillium': 'https://docs.alliancecan.ca/wiki/Trillium_Quickstart (1 GPU or a multiple of 4; --mem '
                   'ignored; no local disk: $SLURM_TMPDIR is in memory)',
    'ac-alloc': 'https://docs.alliancecan.ca/wiki/Allocations_and_compute_scheduling (cores and memory per GPU)',
    'ac-gpus': 'https://docs.alliancecan.ca/wiki/Using_GPUs_with_Slurm (--gpus-per-node=<model>:<n>)',
    'ac-python': 'https://docs.alliancecan.ca/wiki/Python (module load python/3.11; virtualenv --no-download '
                 '$SLURM_TMPDIR/env; pip install --no-index; one per node)',
    'ac-jobs': 'https://docs.alliancecan.ca/wiki/Running_jobs (256 MB per core without --mem)',
    'ac-mps': 'https://docs.alliancecan.ca/wiki/Hyper-Q_/_MPS (CUDA_MPS_PIPE_DIRECTORY, nvidia-cuda-mps-control -d)',
    'ac-local': 'https://docs.alliancecan.ca/wiki/Using_node-local_storage (copy the data to $SLURM_TMPDIR)',
    'jsc-booster': 'https://apps.fz-juelich.de/jsc/hps/juwels/booster-overview.html (4 x A100 40 GB, 48 cores = '
                   '96 threads, 512 GB, 4 x HDR200 InfiniBand)',
    'jsc-course': "JSC's course 'Getting Started with AI on Supercomputers' (../shared/seeds/004_*.txt: "
                  '--partition=booster/develbooster, --account, --mem=0, --cpus-per-task=24 = 96 / 4 GPUs)',
    'jsc-course-2025': 'github.com/HelmholtzAI-FZJ/2025-12-course-Bringing-Deep-Learning-Workloads-to-JSC-'
                       'supercomputers (MASTER_ADDR="${MASTER_ADDR}i"; module load Stages/2025 GCC OpenMPI '
                       'Python PyTorch)',
}

# Node shapes, one entry per kind of GPU node. gpu_type: Alliance Canada asks for --gpus-per-node=<model>:<n>
# (a job without a model "may be rejected"); elsewhere --gres=gpu:<n>. mem_per_gpu: GB per GPU, the site's
# ratio (--mem is the sum per node); mem='0': the whole node's memory; neither: memory comes with the cores
# (Jean Zay). threads: Slurm counts hardware threads there (2 per core). stage: the node
# has a local disk in $SLURM_TMPDIR, so the script passes --stage-dir there (dlojz copies shards only).
_AC = dict(site='ac', account='def-xyz', modules=['StdEnv/2023', 'python/3.11'], stage=True)
MACHINES = {
# Development QoS: each Jean Zay GPU partition has its own (IDRIS: qos_gpu-dev on V100, qos_gpu_a100-dev on
# A100, qos_gpu_h100-dev on H100). The PyTorch module: 2.4.0 (requirements.txt's floor) exists in each tree
# (the course loads it on A100; user scripts load it under arch/h100); `module avail pytorch-gpu` lists the
# versions, IDRIS's H100 examples load 2.5.0 and later.
    'v100': dict(site='jz', title='Jean Zay V100 (32 GB, gpu_p13)', gpus_per_node=4, cpus_per_task=10,
                 constraint='v100-32g', modules=['pytorch-gpu/py3/2.4.0'], account='xyz@v100', qos_dev='qos_gpu-dev',
                 sources=['idris-gpu', 'idris-templates']),
    'a100': dict(site='jz', title='Jean Zay A100 (80 GB, gpu_p5)', gpus_per_node=8, cpus_per_task=8, constraint='a100',
                 modules=['arch/a100', 'pytorch-gpu/py3/2.4.0'], account='xyz@a100', qos_dev='qos_gpu_a100-dev',
                 sources=['idris-gpu', 'idris-templates']),
    'h100': dict(site='jz', title='Jean Zay H100 (80 GB, gpu_p6)', gpus_per_node=4, cpus_per_task=24,
                 constraint='h100', modules=['arch/h100', 'pytorch-gpu/py3/2.4.0'], account='xyz@h100',
                 qos_dev='qos_gpu_h100-dev', sources=['idris-gpu', 'idris-templates']),
    'narval': dict(_AC, title='Alliance Canada Narval (A100 40 GB)', gpus_per_node=4, gpu_type='a100',
                   cpus_per_task=12, mem_per_gpu=124, sources=['ac-narval', 'ac-alloc', 'ac-gpus', 'ac-python']),
    'rorqual': dict(_AC, title='Alliance Canada Rorqual (H100 80 GB)', gpus_per_node=4, gpu_type='h100',
                    cpus_per_task=16, mem_per_gpu=124, sources=['ac-rorqual', 'ac-alloc', 'ac-gpus', 'ac-python']),
    'fir': dict(_AC, title='Alliance Canada Fir (H100 80 GB)', gpus_per_node=4, gpu_type='h100', cpus_per_task=12,
                mem_per_gpu=280, sources=['ac-fir', 'ac-alloc', 'ac-gpus', 'ac-python']),
    'nibi': dict(_AC, title='Alliance Canada Nibi (H100 80 GB, 8 per node)', gpus_per_node=8, gpu_type='h100',
                 cpus_per_task=14, mem_per_gpu=250, sources=['ac-nibi', 'ac-alloc', 'ac-gpus', 'ac-python']),
    # --mem is ignored there (each GPU comes with 188 GB) and $SLURM_TMPDIR is a RAM disk: no staging
    'trillium': dict(_AC, title='Alliance Canada Trillium (H100 80 GB)', gpus_per_node=4, gpu_type='h100',
                     cpus_per_task=24, stage=False, gpus_allowed='1 or a multiple of 4',
                     sources=['ac-trillium', 'ac-alloc', 'ac-gpus', 'ac-python']),
    'booster': dict(site='jsc', title='JSC JUWELS Booster (A100 40 GB)', gpus_per_node=4, cpus_per_task=24,
                    threads=True, mem='0', partition='booster', partition_dev='develbooster', account='xyz',
                    modules=['Stages/2025', 'GCC', 'OpenMPI', 'Python', 'PyTorch'], master_suffix='i',
                    sources=['jsc-booster', 'jsc-course', 'jsc-course-2025']),
    'generic': dict(site='generic', title='a generic GPU cluster', gpus_per_node=4, cpus_per_task=8,
                    account='def-xyz'),
    'cpu': dict(site='cpu', title='CPU nodes (gloo)', gpus_per_node=0, cpus_per_task=2),
}
# Jean Zay's 8-GPU V100 nodes are partitions, not constraints: 8 GPUs and 24 cores (3 per GPU), 32 GB each.
PARTITIONS = {('v100', p): dict(title=f'Jean Zay V100 (32 GB, 8 per node, {p})', gpus_per_node=8, cpus_per_task=3,
                                constraint=None) for p in ('gpu_p2', 'gpu_p2s', 'gpu_p2l')}

# Interconnects, for dlojz_scaling's forecast when no probe was run. Bandwidths in bytes/s in each direction
# (what one rank sends while it receives as much); latencies in seconds per ring step. Sources:
# - NVLink: NVIDIA's datasheets give the total of both directions per GPU: V100 SXM2 300 GB/s (NVLink2,
#   6 links x 25 GB/s each way: a 4-GPU node without NVSwitch joins each pair by 2 links, and NCCL's 3 rings
#   use all 6), A100 SXM4 600 GB/s (NVLink3, 12 links, NVSwitch on 8-GPU boards), H100 SXM5 900 GB/s (NVLink4).
# - PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding = 31.5 GB/s each way (PCI-SIG).
# - Ring latency per step: NCCL's own tuning model (src/graph/tuning.cc, hwLat, Ring/Simple protocol):
#   NVLink 3.4 us, PCIe 5.7 us, network 9.6 us.
# - Jean Zay's networks, per node (IDRIS's Jean Zay hardware page, as read when this was written; it could
#   not be checked from here: `ibstat` on a node says): V100 nodes 4 x Omni-Path 100 Gb/s, A100 nodes (gpu_p5)
#   4 x InfiniBand HDR 200 Gb/s, H100 nodes (gpu_p6) 4 x InfiniBand NDR 400 Gb/s. Gb/s / 8 = GB/s each way.
#   JUWELS Booster: 4 x HDR200 per node (jsc-booster). The Alliance clusters' networks per GPU node were not
#   confirmed: no network figures (a forecast beyond one node says so; measure with --probe).
# Peak figures: NCCL reaches roughly 80 % of them on large buffers, so a forecast from them is optimistic.
GB = 1e9
_NVL3 = dict(intra='NVLink3', intra_bw=300 * GB, intra_lat=3.4e-6)
_NVL4 = dict(intra='NVLink4', intra_bw=450 * GB, intra_lat=3.4e-6)
_NO_NET = dict(net='not confirmed', net_bw=None, net_lat=None)
INTERCONNECTS = {
    'v100': dict(intra='NVLink2', intra_bw=150 * GB, intra_lat=3.4e-6, net='4 x Omni-Path 100 Gb/s',
                 net_bw=4 * 100 / 8 * GB, net_lat=9.6e-6),
    'a100': dict(intra='NVLink3 + NVSwitch', intra_bw=300 * GB, intra_lat=3.4e-6, net='4 x InfiniBand HDR 200 Gb/s',
                 net_bw=4 * 200 / 8 * GB, net_lat=9.6e-6),
    'h100': dict(intra='NVLink4 + NVSwitch', intra_bw=450 * GB, intra_lat=3.4e-6, net='4 x InfiniBand NDR 400 Gb/s',
                 net_bw=4 * 400 / 8 * GB, net_lat=9.6e-6),
    'narval': dict(_NVL3, **_NO_NET), 'rorqual': dict(_NVL4, **_NO_NET), 'fir': dict(_NVL4, **_NO_NET),
    'nibi': dict(_NVL4, **_NO_NET), 'trillium': dict(_NVL4, **_NO_NET),
    'booster': dict(_NVL3, net='4 x InfiniBand HDR 200 Gb/s', net_bw=4 * 200 / 8 * GB, net_lat=9.6e-6),
    # an assumption, not a measurement: GPUs on PCIe 4.0, one 100 Gb/s link per node
    'generic': dict(intra='PCIe 4.0 x16', intra_bw=31.5 * GB, intra_lat=5.7e-6, net='1 x 100 Gb/s',
                    net_bw=100 / 8 * GB, net_lat=9.6e-6),
}
for _name, _ic in INTERCONNECTS.items():
    MACHINES[_name]['interconnect'] = _ic
# (machine, GPUs, ranks per GPU) of the scripts in slurm/: one GPU, one full node, two nodes per site; the MPS
# script of the Alliance Canada guide (4 ranks on one GPU).
SHIPPED = [(m, g, 1) for m in ('v100', 'a100', 'h100', 'narval', 'booster')
           for g in (1, MACHINES[m]['gpus_per_node'], 2 * MACHINES[m]['gpus_per_node'])] + \
    [('narval', 1, 4), ('generic', 4, 1), ('cpu', 0, 1)]
PREFIX = {'jz': 'jz-', 'ac': 'ac-', 'jsc': 'jsc-'}


def spec(machine, partition=None):
    """The node shape, with a partition's own shape where it has one (Jean Zay's gpu_p2)."""
    return {**MACHINES[machine], **PARTITIONS.get((machine, partition), {})}


def script_name(machine, gpus, ranks_per_gpu=1, partition=None):
    if machine == 'cpu':
        return 'cpu.slurm'
    prefix = PREFIX.get(MACHINES[machine]['site'], '')
    part = f'-{partition}' if (machine, partition) in PARTITIONS else ''
    mps = f'-mps{ranks_per_gpu}' if ranks_per_gpu > 1 else ''
    return f'{prefix}{machine}{part}-{gpus}gpu{mps}.slurm'


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


def command(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None, ranks_per_gpu=1):
    """The dlojz_slurm.py command that renders this script."""
    extra = [f'--{k} {v}' for k, v in (('account', account), ('qos', qos), ('partition', partition),
                                       ('ranks-per-gpu', ranks_per_gpu if ranks_per_gpu > 1 else None)) if v]
    return ' '.join(['python dlojz_slurm.py --machine', machine, '--gpus', str(gpus), '--time', time_limit, *extra,
                     '--dry-run'])


def sbatch_options(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None, ranks_per_gpu=1):
    """-> [(option, why)]; an option starting with '#' is printed commented out (##SBATCH)."""
    m = spec(machine, partition)
    nodes, per_node = shape(machine, gpus, partition)
    name = script_name(machine, gpus, ranks_per_gpu, partition)[:-len('.slurm')]
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
        opts.append((f'--mem={m["mem"]}', 'all of the node\'s memory'))
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


def render(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None, ranks_per_gpu=1):
    """The batch script. account/qos/partition: given, they are set; else the script shows where they go."""
    m = spec(machine, partition)
    nodes, per_node = shape(machine, gpus, partition)
    what = 'CPU only, one task' if machine == 'cpu' else \
        f'{gpus} GPU(s) = {nodes} node(s) x {per_node} GPU(s), ' + \
        (f'{ranks_per_gpu} tasks per GPU (MPS)' if ranks_per_gpu > 1 else 'one task per GPU')
    opts = sbatch_options(machine, gpus, time_limit, account, qos, partition, ranks_per_gpu)
    sources = m.get('sources', []) + (['ac-local'] if m.get('stage') else []) + \
        (['ac-mps'] if ranks_per_gpu > 1 else [])
    L = ['#!/bin/bash',
         f'# dlojz on {m["title"]}: {what}.',
         '# Submit from the repository root:  sbatch <this script> [dlojz flags, e.g. --test-nsteps 50]',
         f'# Made by: {command(machine, gpus, time_limit, account, qos, partition, ranks_per_gpu)}',
         '# (the scripts of slurm/ come from `python dlojz_slurm.py --write`): change the generator, or the lines '
         'marked ADAPT.',
         f'# Sources: docs/slurm.md#sites ({", ".join(sources)})' if sources else None]
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
    if machine == 'cpu':
        L.append('    --device cpu \\')
    if m.get('stage'):
        # quoted: each task expands its own node's $SLURM_TMPDIR (dlojz reads the variable), not the batch shell
        L.append("    --stage-dir '$SLURM_TMPDIR' \\")  # shards are copied to the local disk; other data read in place
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


def write_all(folder=os.path.join(HERE, 'slurm')):
    os.makedirs(os.path.join(folder, 'log'), exist_ok=True)
    written = []
    for machine, gpus, ranks in SHIPPED:
        path = os.path.join(folder, script_name(machine, gpus, ranks))
        with open(path, 'w') as f:
            f.write(render(machine, gpus, ranks_per_gpu=ranks))
        written.append(path)
    return written


def parse(argv):
    """Helper flags -> render()'s arguments (machine, gpus, time, account, qos, partition, ranks per GPU)."""
    a = parser().parse_args(argv)
    return a.machine, a.gpus, a.time, a.account, a.qos, a.partition, a.ranks_per_gpu


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
        text = render(args.machine, args.gpus, args.time, args.account, args.qos, args.partition, args.ranks_per_gpu)
    except ValueError as e:
        print(f'dlojz_slurm: error: {e}', file=sys.stderr)
        return 2
    flags = [f for f in args.dlojz_flags if f != '--']
    if args.dry_run:
        print(text, end='')
        print(f'# would run: sbatch <this script> {" ".join(flags)}')
        return 0
    os.makedirs(os.path.join(HERE, 'slurm', 'log'), exist_ok=True)
    with tempfile.NamedTemporaryFile('w', suffix='.slurm', dir=os.path.join(HERE, 'slurm'), delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run(['sbatch', '--parsable', f.name, *flags], capture_output=True, text=True, cwd=HERE)
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
