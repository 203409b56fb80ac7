"""The compute nodes dlojz knows, per site: their shapes (GPUs, cores, memory per GPU, modules),
Jean Zay's partitions and each machine's interconnect, with where each value comes from. The SLURM
scripts (tools/slurm.py) and the scaling forecast (measure/scaling.py) read the same tables."""
# Where each value below comes from (the table in docs/slurm.md repeats them, and
# tests/test_slurm_scripts.py checks the two against each other). Alliance Canada's wiki pages were
# read in their source as of 2026-05; JSC's node facts from its system page, its job conventions
# from its courses.
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

# Node shapes, one entry per kind of GPU node. gpu_type: Alliance Canada asks for
# --gpus-per-node=<model>:<n> (a job without a model "may be rejected"); elsewhere --gres=gpu:<n>.
# mem_per_gpu: GB per GPU, the site's ratio (--mem is the sum per node); mem='0': the whole node's
# memory; neither: memory comes with the cores (Jean Zay). threads: Slurm counts hardware threads
# there (2 per core). stage: the node has a local disk in $SLURM_TMPDIR, so the script passes
# --stage-dir there (dlojz copies shards only).
_AC = dict(site='ac', account='def-xyz', modules=['StdEnv/2023', 'python/3.11'], stage=True)
MACHINES = {
# Development QoS: each Jean Zay GPU partition has its own (IDRIS: qos_gpu-dev on V100,
# qos_gpu_a100-dev on A100, qos_gpu_h100-dev on H100). The PyTorch module: 2.4.0 (requirements.txt's
# floor) exists in each tree (the course loads it on A100; user scripts load it under arch/h100);
# `module avail pytorch-gpu` lists the versions, IDRIS's H100 examples load 2.5.0 and later.
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
    # mem='0': a script that asks for no memory gets the site's default, 256 MB per core at Alliance
    # Canada (ac-jobs), and is killed for it before its first step
    'generic': dict(site='generic', title='a generic GPU cluster', gpus_per_node=4, cpus_per_task=8,
                    account='def-xyz', mem='0',
                    mem_note="ADAPT: the node's memory (or --mem-per-gpu=<GB>G)"),
    'cpu': dict(site='cpu', title='CPU nodes (gloo)', gpus_per_node=0, cpus_per_task=2),
}
# Jean Zay's 8-GPU V100 nodes are partitions, not constraints: 8 GPUs and 24 cores (3 per GPU), 32
# GB each.
PARTITIONS = {('v100', p): dict(title=f'Jean Zay V100 (32 GB, 8 per node, {p})', gpus_per_node=8, cpus_per_task=3,
                                constraint=None) for p in ('gpu_p2', 'gpu_p2s', 'gpu_p2l')}

# Interconnects, for measure/scaling.py's forecast when no probe was run. Bandwidths in bytes/s in each direction
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
