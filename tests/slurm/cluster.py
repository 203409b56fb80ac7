"""A real single-machine Slurm for the tests: Debian's slurmctld/slurmd/munge (Slurm 22.05), two emulated
nodes with 16 fake GPUs (8 typed a100, 8 h100) and 128 advertised CPUs each, a per-node $SLURM_TMPDIR (a
TaskProlog), all traffic on localhost.

Nothing on the machine is changed unless asked: the tests run only with DLOJZ_SLURM_SETUP=1, as root, with
the packages already installed (.ci/run installs them with apt-get and sets the variable); the fixture
installs nothing and never edits /etc/hosts. Everything else lives in one state directory (configuration
via $SLURM_CONF, nothing written under /etc/slurm); the ports are free ones picked at start-up, so two
suites can run side by side; only the daemons started here are stopped, by their pid files.

Why the settings are what they are (measured on Debian 12 with Slurm 22.05.8):
- no systemd and package scripts start no service: munged (as user munge), slurmctld and slurmd are
  started by hand, each with its stdio in a log file (a daemon holding a caller's pipes blocks it);
- the nodes are named after loopback addresses (127.0.0.1, 127.0.0.2): inside a job dlojz joins the
  process group at the first node's name, which must resolve, and Slurm reaches each slurmd there on its
  own port (one `slurmd -N <node>` per emulated node); no /etc/hosts entry is needed;
- fake GPUs are character devices with NVIDIA's major (195): file-less GRES drain the node, regular files
  only warn; more CPUs/GPUs than the machine has need SlurmdParameters=config_overrides;
- EnforcePartLimits=ALL refuses impossible jobs at submission instead of leaving them pending forever;
  batch_sched_delay=0 starts back-to-back jobs at once (3 s apart otherwise); MailProg=/bin/true because
  there is no mail(1); jobcomp/filetxt records outcomes without slurmdbd;
- FirstJobId is random: dlojz derives its rendezvous port from the job id (20000 + id % 20000).

    cluster = Cluster(state_dir).up()    # ~6 s
    ...                                   # sbatch with env=cluster.env
    cluster.down()
"""
import os
import random
import shutil
import socket
import subprocess
import time

PACKAGES = ['slurmctld', 'slurmd', 'slurm-client', 'munge']
ENABLE = 'DLOJZ_SLURM_SETUP'
HOW = (f'{ENABLE}=1 python -m pytest -q -m slurm tests/slurm, as root, after apt-get install '
       f'--no-install-recommends {" ".join(PACKAGES)}')


def why_unavailable():
    """None when a cluster may be brought up here, else the reason (for pytest.skip)."""
    if os.environ.get(ENABLE) != '1':
        return f'the real-Slurm tests start Slurm and munge daemons on this machine; to run them: {HOW}'
    if os.geteuid() != 0:
        return f'{ENABLE}=1 but slurmctld/slurmd need root'
    missing = [b for b in ('slurmctld', 'slurmd', 'sbatch', 'munged') if not shutil.which(b, path='/usr/sbin:/usr/bin')]
    if missing:
        return (f'{ENABLE}=1 but {", ".join(missing)} not found; the tests install nothing: apt-get install '
                f'--no-install-recommends {" ".join(PACKAGES)}')
    return None


def node_names():
    """The emulated nodes are named after loopback addresses, which need no name resolution: dlojz joins the
    process group at the first node's name, and an /etc/hosts entry for node1/node2 would change the system.
    (Slurm maps a node named localhost to the host name, so localhost and the host name collide.)"""
    return ['127.0.0.1', '127.0.0.2']


def free_ports(n):
    """n distinct TCP ports that nothing listens on now (the kernel picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(('127.0.0.1', 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    def __init__(self, state_dir):
        self.d = os.path.abspath(state_dir)
        self.nodes = node_names()
        self.ctld_port, *self.node_ports = free_ports(1 + len(self.nodes))
        self.conf = os.path.join(self.d, 'slurm.conf')
        self.env = {**os.environ, 'SLURM_CONF': self.conf}
        self.pidfiles = []  # (pid file, expected /proc/PID/comm) of what we started

    # ------------------------------------------------------------------ set-up
    def up(self, timeout=60):
        for sub in ('state/ctld', 'run', 'log', *(f'state/slurmd-{n}' for n in self.nodes)):
            os.makedirs(os.path.join(self.d, sub), exist_ok=True)
        self._write_config()
        self._start_munge()
        self._daemon(['/usr/sbin/slurmctld', '-f', self.conf], 'run/slurmctld.pid', 'slurmctld')
        for node in self.nodes:
            self._daemon(['/usr/sbin/slurmd', '-f', self.conf, '-N', node], f'run/slurmd-{node}.pid', 'slurmd')
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.run('sinfo', '-h', '-N', '-o', '%N %T', check=False).stdout.split()
            if states.count('idle') == len(self.nodes):
                return self
            time.sleep(0.2)
        raise RuntimeError(f'Slurm nodes not idle after {timeout} s: {states}; see {self.d}/log')

    def _write_config(self):
        d = self.d
        fake = os.path.join(d, 'fakegpu')
        gres = []
        for node in self.nodes:
            os.makedirs(os.path.join(fake, node), exist_ok=True)
            for i in range(16):
                dev = os.path.join(fake, node, f'nvidia{i}')
                if not os.path.exists(dev):
                    os.mknod(dev, 0o600 | 0o020000, os.makedev(195, i))  # character device, NVIDIA major
            # typed: Alliance Canada's scripts ask for --gpus-per-node=a100:N; untyped requests take either type
            gres.append(f'NodeName={node} Name=gpu Type=a100 File={fake}/{node}/nvidia[0-7]')
            gres.append(f'NodeName={node} Name=gpu Type=h100 File={fake}/{node}/nvidia[8-15]')
        # a per-node, per-job $SLURM_TMPDIR, as Alliance Canada's nodes give each job on their local disk
        prolog = os.path.join(d, 'taskprolog.sh')
        with open(prolog, 'w') as f:
            f.write(f'#!/bin/sh\nd={d}/localdisk/$SLURMD_NODENAME/job$SLURM_JOB_ID\nmkdir -p "$d"\n'
                    f'echo "export SLURM_TMPDIR=$d"\n')
        os.chmod(prolog, 0o755)
        lines = [
            'ClusterName=dlojztest', 'SlurmctldHost=localhost', 'SlurmUser=root', 'SlurmdUser=root',
            'AuthType=auth/munge', 'CredType=cred/munge', f'SlurmctldPort={self.ctld_port}',
            f'SlurmdPort={self.node_ports[0]}', f'FirstJobId={random.randrange(1000, 19000)}',
            f'StateSaveLocation={d}/state/ctld', f'SlurmdSpoolDir={d}/state/slurmd-%n',
            f'SlurmctldPidFile={d}/run/slurmctld.pid', f'SlurmdPidFile={d}/run/slurmd-%n.pid',
            f'SlurmctldLogFile={d}/log/slurmctld.log', f'SlurmdLogFile={d}/log/slurmd-%n.log',
            'SelectType=select/cons_tres', 'SelectTypeParameters=CR_Core', 'SchedulerType=sched/backfill',
            'SchedulerParameters=batch_sched_delay=0', 'MpiDefault=none', 'ReturnToService=2',
            'EnforcePartLimits=ALL', 'KillWait=10', 'MinJobAge=300', 'InactiveLimit=0', 'SlurmdTimeout=300',
            'Waittime=0', 'JobCompType=jobcomp/filetxt', f'JobCompLoc={d}/log/jobcomp.txt', 'MailProg=/bin/true',
            'ProctrackType=proctrack/linuxproc', 'TaskPlugin=task/none', 'JobAcctGatherType=jobacct_gather/none',
            'AccountingStorageType=accounting_storage/none', 'GresTypes=gpu', 'SlurmdParameters=config_overrides',
            f'TaskProlog={prolog}',
        ]
        for node, port in zip(self.nodes, self.node_ports):
            # 128 CPUs, 16 GPUs (8 a100 + 8 h100) and 600 GB advertised: room for every shipped script's node
            # (JUWELS Booster's 96 threads, Narval's 496 GB); the features the scripts ask for. Each node its own
            # NodeHostname: two nodes on one host name are refused ("Duplicated NodeHostName")
            lines.append(f'NodeName={node} NodeHostname={node} NodeAddr={node} Port={port} CPUs=128 '
                         f'Boards=1 SocketsPerBoard=1 CoresPerSocket=128 ThreadsPerCore=1 RealMemory=600000 '
                         f'Gres=gpu:a100:8,gpu:h100:8 Features=v100-32g,a100,h100 State=UNKNOWN')
        lines.append(f'PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP')
        with open(self.conf, 'w') as f:
            f.write('\n'.join(lines) + '\n')
        with open(os.path.join(d, 'gres.conf'), 'w') as f:
            f.write('\n'.join(gres) + '\n')

    def _start_munge(self):
        if subprocess.run('munge -n | unmunge', shell=True, capture_output=True).returncode == 0:
            return  # a munged is already serving: not ours to start or stop
        if not os.path.exists('/etc/munge/munge.key'):  # the munge package creates it; the tests do not
            raise RuntimeError('/etc/munge/munge.key is missing: create it with mungekey --create (as root)')
        subprocess.run(['install', '-d', '-o', 'munge', '-g', 'munge', '/run/munge'], check=True)
        self._daemon(['runuser', '-u', 'munge', '--', '/usr/sbin/munged'], None, 'munged',
                     pidfile='/run/munge/munged.pid')
        for _ in range(50):
            if subprocess.run('munge -n | unmunge', shell=True, capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError('munged did not start')

    def _daemon(self, cmd, pid_rel, comm, pidfile=None):
        log = open(os.path.join(self.d, 'log', f'{comm}.stderr'), 'a')
        # stdio to files: a daemon holding our pipes would block a caller reading them until EOF
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, env=self.env, timeout=60)
        path = pidfile or os.path.join(self.d, pid_rel)
        for _ in range(100):
            if os.path.exists(path):
                break
            time.sleep(0.05)
        self.pidfiles.append((path, comm))

    # ------------------------------------------------------------------ use
    def run(self, *cmd, check=True, timeout=60):
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, check=check, timeout=timeout)

    def sbatch(self, script, *args, env=None, cwd=None, options=()):
        r = subprocess.run(['sbatch', '--parsable', *options, script, *[str(a) for a in args]], capture_output=True,
                           text=True, env={**self.env, **(env or {})}, cwd=cwd, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f'sbatch {script} failed: {r.stderr.strip()}')
        return r.stdout.strip().split(';')[0]

    def job(self, job_id):
        """scontrol's fields for a job (JobState, ExitCode, Restarts...), {} once it has been purged."""
        r = self.run('scontrol', 'show', 'job', '-o', job_id, check=False)
        return dict(kv.split('=', 1) for kv in r.stdout.split() if '=' in kv)

    def wait(self, job_id, timeout=300, states=('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL',
                                                   'OUT_OF_MEMORY')):
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get('JobState') in states:
                return info
            time.sleep(0.2)
        raise TimeoutError(f'job {job_id} still {self.job(job_id).get("JobState")} after {timeout} s')

    # ------------------------------------------------------------------ tear-down
    def down(self):
        if shutil.which('squeue'):
            self.run('scancel', '--full', '--user', 'root', check=False)
        for path, comm in reversed(self.pidfiles):  # slurmd, slurmctld, then munged
            try:
                pid = int(open(path).read().split()[0])
                with open(f'/proc/{pid}/comm') as f:
                    if f.read().strip() != comm:
                        continue  # the pid was reused by something else: not ours
                os.kill(pid, 15)
                for _ in range(200):
                    if not os.path.exists(f'/proc/{pid}'):
                        break
                    time.sleep(0.05)
            except (OSError, ValueError):
                continue
        self.pidfiles = []
