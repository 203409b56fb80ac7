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

# Node shapes. Jean Zay: V100 nodes 4 GPUs/40 cores (gpu_p13, -C v100-32g), A100 nodes 8 GPUs/64 cores
# (-C a100), H100 nodes 4 GPUs/96 cores (-C h100); reference/course.md §6 and IDRIS's documentation.
MACHINES = {
# Development QoS: each Jean Zay GPU partition has its own (IDRIS: qos_gpu-dev on V100, qos_gpu_a100-dev on
# A100, qos_gpu_h100-dev on H100).
    'v100': dict(site='jz', title='Jean Zay V100 (32 GB)', gpus_per_node=4, cpus_per_task=10, constraint='v100-32g',
                 modules=['pytorch-gpu/py3/2.4.0'], account='xyz@v100', qos_dev='qos_gpu-dev'),
    'a100': dict(site='jz', title='Jean Zay A100', gpus_per_node=8, cpus_per_task=8, constraint='a100',
                 modules=['arch/a100', 'pytorch-gpu/py3/2.4.0'], account='xyz@a100', qos_dev='qos_gpu_a100-dev'),
    'h100': dict(site='jz', title='Jean Zay H100', gpus_per_node=4, cpus_per_task=24, constraint='h100',
                 modules=['arch/h100', 'pytorch-gpu/py3/2.4.0'], account='xyz@h100', qos_dev='qos_gpu_h100-dev'),
    'generic': dict(site='generic', title='a generic GPU cluster (Alliance Canada, JSC...)', gpus_per_node=4,
                    cpus_per_task=8, constraint=None, modules=None, account='def-xyz'),
    'cpu': dict(site='cpu', title='CPU nodes (gloo)', gpus_per_node=0, cpus_per_task=2, constraint=None,
                modules=None, account=None),
}

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
# Peak figures: NCCL reaches roughly 80 % of them on large buffers, so a forecast from them is optimistic.
GB = 1e9
INTERCONNECTS = {
    'v100': dict(intra='NVLink2', intra_bw=150 * GB, intra_lat=3.4e-6, net='4 x Omni-Path 100 Gb/s',
                 net_bw=4 * 100 / 8 * GB, net_lat=9.6e-6),
    'a100': dict(intra='NVLink3 + NVSwitch', intra_bw=300 * GB, intra_lat=3.4e-6, net='4 x InfiniBand HDR 200 Gb/s',
                 net_bw=4 * 200 / 8 * GB, net_lat=9.6e-6),
    'h100': dict(intra='NVLink4 + NVSwitch', intra_bw=450 * GB, intra_lat=3.4e-6, net='4 x InfiniBand NDR 400 Gb/s',
                 net_bw=4 * 400 / 8 * GB, net_lat=9.6e-6),
    # an assumption, not a measurement: GPUs on PCIe 4.0, one 100 Gb/s link per node
    'generic': dict(intra='PCIe 4.0 x16', intra_bw=31.5 * GB, intra_lat=5.7e-6, net='1 x 100 Gb/s',
                    net_bw=100 / 8 * GB, net_lat=9.6e-6),
}
for _name, _ic in INTERCONNECTS.items():
    MACHINES[_name]['interconnect'] = _ic
# (machine, GPUs) of the scripts in slurm/: one GPU, one full node, two nodes.
SHIPPED = [(m, g) for m in ('v100', 'a100', 'h100')
           for g in (1, MACHINES[m]['gpus_per_node'], 2 * MACHINES[m]['gpus_per_node'])] + [('generic', 4), ('cpu', 0)]


def script_name(machine, gpus):
    if machine == 'cpu':
        return 'cpu.slurm'
    prefix = 'jz-' if MACHINES[machine]['site'] == 'jz' else ''
    return f'{prefix}{machine}-{gpus}gpu.slurm'


def shape(machine, gpus):
    """-> (nodes, tasks per node): one task per GPU, whole nodes beyond one node."""
    cap = MACHINES[machine]['gpus_per_node']
    if machine == 'cpu':
        return 1, 1
    if gpus < 1:
        raise ValueError(f'--gpus {gpus}: ask for at least 1 GPU (--machine cpu runs without any).')
    if gpus > cap and gpus % cap:
        raise ValueError(f'{gpus} GPUs on {machine} nodes of {cap} GPUs: ask for at most {cap}, or a multiple of it.')
    return max(1, gpus // cap), min(gpus, cap)


def command(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None):
    """The dlojz_slurm.py command that renders this script."""
    extra = [f'--{k} {v}' for k, v in (('account', account), ('qos', qos), ('partition', partition)) if v]
    return ' '.join(['python dlojz_slurm.py --machine', machine, '--gpus', str(gpus), '--time', time_limit, *extra,
                     '--dry-run'])


def render(machine, gpus, time_limit='02:00:00', account=None, qos=None, partition=None):
    """The batch script. account/qos/partition: given, they are set; else the script shows where they go."""
    m = MACHINES[machine]
    nodes, per_node = shape(machine, gpus)
    name = script_name(machine, gpus)[:-len('.slurm')]
    tasks = nodes * per_node
    what = 'CPU only, one task' if machine == 'cpu' else \
        f'{gpus} GPU(s) = {nodes} node(s) x {per_node} GPU(s), one task per GPU'
    opts = [(f'--job-name=dlojz-{name}', 'name in squeue and in the log file names'),
            (f'--output=slurm/log/%x_%j_{nodes}nodes_{tasks}tasks.out', '%x job name, %j job id'),
            (f'--error=slurm/log/%x_%j_{nodes}nodes_{tasks}tasks.err', 'stderr, same name'),
            ('--open-mode=append', 'a requeued job appends to the same logs'),
            (f'--nodes={nodes}', 'nodes'),
            (f'--ntasks-per-node={per_node}', 'one task per GPU: each task drives one GPU')]
    if machine != 'cpu':
        opts.append((f'--gres=gpu:{per_node}', 'GPUs per node'))
    opts += [(f'--cpus-per-task={m["cpus_per_task"]}', 'cores per task: dlojz uses them as DataLoader workers'),
             ('--hint=nomultithread', 'physical cores only, no hyperthreads'),
             (f'--time={time_limit}', 'ADAPT: wall-time limit (requeue continues longer runs)')]
    if m['constraint']:
        opts.append((f'--constraint={m["constraint"]}', f'the {machine.upper()} partition'))
    if account:
        opts.append((f'--account={account}', 'the project the hours are charged to'))
    elif m['site'] == 'jz':
        opts.append((f'--account={m["account"]}', f'ADAPT: your project (idrproj), with the @{machine} suffix'))
    elif m['account']:
        opts.append((f'#--account={m["account"]}', 'ADAPT: your allocation'))
    if qos:
        opts.append((f'--qos={qos}', 'quality of service'))
    elif m.get('qos_dev'):
        opts.append((f'#--qos={m["qos_dev"]}', f'ADAPT: uncomment for short development jobs on {machine.upper()}'))
    if partition:
        opts.append((f'--partition={partition}', 'partition'))
    elif m['site'] != 'jz':
        opts.append((f'#--partition={"cpu" if machine == "cpu" else "gpu"}', 'ADAPT: your partition, if not the '
                     'default'))
    opts += [('--signal=USR2@120', 'SIGUSR2 120 s before the limit: dlojz checkpoints and requeues'),
             ('--requeue', 'allow that requeue (and requeue after preemption)')]
    L = ['#!/bin/bash',
         f'# dlojz on {m["title"]}: {what}.',
         '# Submit from the repository root:  sbatch <this script> [dlojz flags, e.g. --test-nsteps 50]',
         f'# Made by: {command(machine, gpus, time_limit, account, qos, partition)}',
         '# (the scripts of slurm/ come from `python dlojz_slurm.py --write`): change the generator, or the lines '
         'marked ADAPT.']
    # a leading '#' in the option makes a commented-out '##SBATCH' line
    L += [(f'##SBATCH {o[1:]:<44}' if o.startswith('#') else f'#SBATCH {o:<45}') + f'# {c}' for o, c in opts]
    L.append('')
    if m['site'] == 'jz':
        L += ['module purge                              # ADAPT: the software environment']
        L += [f'module load {mod}' + ('  # A100/H100 nodes have their own module tree' if mod.startswith('arch/') else
                                      '  # ADAPT: version') for mod in m['modules']]
    else:
        L += ['source "${DLOJZ_VENV:-.venv}/bin/activate"  # ADAPT: the virtual environment with requirements.txt']
    L += ['',
          '# srun >= 22.05 no longer passes --cpus-per-task on to its tasks: without this each task may get one',
          '# core for its DataLoader workers',
          'export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK',
          '# The run folder, runs/<run name>, does not depend on the job id: resubmitting this script with the same',
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
    L += ['    "$@" &',
          'SRUN_PID=$!',
          '# A signal for this shell alone (scancel --batch --signal=USR2, #SBATCH --signal=B:USR2@120) is passed',
          '# on to srun, which forwards it to the tasks. SIGTERM is not: srun answers it by killing the tasks.',
          "trap 'kill -USR2 $SRUN_PID 2>/dev/null' USR2",
          'wait $SRUN_PID',
          'while kill -0 $SRUN_PID 2>/dev/null; do wait $SRUN_PID; done  # a trap ends a wait early',
          'wait $SRUN_PID; code=$?  # srun\'s status: bash keeps that of its last background job',
          'exit $code', '']
    return '\n'.join(L)


def write_all(folder=os.path.join(HERE, 'slurm')):
    os.makedirs(os.path.join(folder, 'log'), exist_ok=True)
    written = []
    for machine, gpus in SHIPPED:
        path = os.path.join(folder, script_name(machine, gpus))
        with open(path, 'w') as f:
            f.write(render(machine, gpus))
        written.append(path)
    return written


def parse(argv):
    """Helper flags -> render()'s arguments (machine, gpus, time, account, qos, partition)."""
    a = parser().parse_args(argv)
    return a.machine, a.gpus, a.time, a.account, a.qos, a.partition


def parser():
    p = argparse.ArgumentParser(prog='dlojz_slurm.py', description=__doc__.split('\n\n')[0].replace('\n', ' '),
                                epilog=__doc__[__doc__.index('\n\n') + 2:], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--machine', choices=sorted(MACHINES), default='a100', help='node shape: ' + '; '.join(
        f"{m}: {MACHINES[m]['title']}" for m in sorted(MACHINES)))
    p.add_argument('--gpus', type=int, default=1, help='GPUs in all (a multiple of the node size beyond one node)')
    p.add_argument('--time', default='02:00:00', help='wall-time limit, HH:MM:SS')
    p.add_argument('--account', help='project to charge (Jean Zay: <idrproj>@a100, @h100 or @v100)')
    p.add_argument('--qos', help='quality of service, e.g. qos_gpu_a100-dev for short A100 tests on Jean Zay')
    p.add_argument('--partition', help='partition, where the cluster needs one')
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
        text = render(args.machine, args.gpus, args.time, args.account, args.qos, args.partition)
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
