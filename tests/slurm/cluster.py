"""A real single-machine Slurm for the tests: Debian's slurmctld/slurmd/munge, two emulated nodes
(node1, node2) with 8 fake GPUs and 64 advertised CPUs each, bound to localhost traffic.

Why each setting: the comment beside it, and Slurm's slurm.conf(5) and gres.conf(5). Everything lives in one state
directory (config via $SLURM_CONF, no file under /etc/slurm is written); /etc/hosts gets node1/node2
for the duration; only the daemons started here are stopped, by their pid files.

    cluster = Cluster(state_dir).up()    # installs the packages if needed (root + apt), ~6-15 s
    ...                                   # sbatch with env=cluster.env
    cluster.down()
"""
import os
import shutil
import socket
import subprocess
import time

PACKAGES = ['slurmctld', 'slurmd', 'slurm-client', 'munge']
NODES = ('node1', 'node2')
HOSTS_TAG = '# dlojz-test-slurm'


def why_unavailable():
    """None when a cluster can be brought up here, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return 'needs root to run slurmctld/slurmd'
    if not shutil.which('slurmctld', path='/usr/sbin:/usr/bin') and not shutil.which('apt-get'):
        return 'Slurm is not installed and apt-get is missing'
    return None


def _install():
    if all(shutil.which(b, path='/usr/sbin:/usr/bin') for b in ('slurmctld', 'slurmd', 'sbatch', 'munged')):
        return
    env = {**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'}
    subprocess.run(['apt-get', 'update', '-qq'], env=env, capture_output=True, timeout=300)
    r = subprocess.run(['apt-get', 'install', '-y', '-qq', '--no-install-recommends', *PACKAGES], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f'apt-get install {" ".join(PACKAGES)} failed: {r.stderr[-500:]}')


class Cluster:
    def __init__(self, state_dir):
        self.d = os.path.abspath(state_dir)
        self.conf = os.path.join(self.d, 'slurm.conf')
        self.env = {**os.environ, 'SLURM_CONF': self.conf}
        self.pidfiles = []  # (pid file, expected /proc/PID/comm) of what we started

    # ------------------------------------------------------------------ set-up
    def up(self, timeout=60):
        _install()
        for sub in ('state/ctld', 'run', 'log', *(f'state/slurmd-{n}' for n in NODES)):
            os.makedirs(os.path.join(self.d, sub), exist_ok=True)
        self._write_config()
        self._hosts(add=True)
        self._start_munge()
        self._daemon(['/usr/sbin/slurmctld', '-f', self.conf], 'run/slurmctld.pid', 'slurmctld')
        for i, node in enumerate(NODES):
            self._daemon(['/usr/sbin/slurmd', '-f', self.conf, '-N', node], f'run/slurmd-{node}.pid', 'slurmd')
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.run('sinfo', '-h', '-N', '-o', '%N %T', check=False).stdout.split()
            if states.count('idle') == len(NODES):
                return self
            time.sleep(0.2)
        raise RuntimeError(f'Slurm nodes not idle after {timeout} s: {states}; see {self.d}/log')

    def _write_config(self):
        d = self.d
        hostname = socket.gethostname()
        fake = os.path.join(d, 'fakegpu')
        gres = []
        for node in NODES:
            os.makedirs(os.path.join(fake, node), exist_ok=True)
            for i in range(8):
                dev = os.path.join(fake, node, f'nvidia{i}')
                if not os.path.exists(dev):
                    os.mknod(dev, 0o600 | 0o020000, os.makedev(195, i))  # character device, NVIDIA major
            gres.append(f'NodeName={node} Name=gpu File={fake}/{node}/nvidia[0-7]')
        lines = [
            'ClusterName=dlojztest', 'SlurmctldHost=localhost', 'SlurmUser=root', 'SlurmdUser=root',
            'AuthType=auth/munge', 'CredType=cred/munge', 'SlurmctldPort=6817', 'SlurmdPort=6818',
            f'StateSaveLocation={d}/state/ctld', f'SlurmdSpoolDir={d}/state/slurmd-%n',
            f'SlurmctldPidFile={d}/run/slurmctld.pid', f'SlurmdPidFile={d}/run/slurmd-%n.pid',
            f'SlurmctldLogFile={d}/log/slurmctld.log', f'SlurmdLogFile={d}/log/slurmd-%n.log',
            'SelectType=select/cons_tres', 'SelectTypeParameters=CR_Core', 'SchedulerType=sched/backfill',
            'SchedulerParameters=batch_sched_delay=0', 'MpiDefault=none', 'ReturnToService=2',
            'EnforcePartLimits=ALL', 'KillWait=10', 'MinJobAge=300', 'InactiveLimit=0', 'SlurmdTimeout=300',
            'Waittime=0', 'JobCompType=jobcomp/filetxt', f'JobCompLoc={d}/log/jobcomp.txt', 'MailProg=/bin/true',
            'ProctrackType=proctrack/linuxproc', 'TaskPlugin=task/none', 'JobAcctGatherType=jobacct_gather/none',
            'AccountingStorageType=accounting_storage/none', 'GresTypes=gpu', 'SlurmdParameters=config_overrides',
        ]
        for i, node in enumerate(NODES):
            # 64 CPUs and 8 GPUs advertised (Jean Zay A100 node shape); the features the scripts ask for
            lines.append(f'NodeName={node} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={6818 + 10 * i} CPUs=64 '
                         f'Boards=1 SocketsPerBoard=1 CoresPerSocket=64 ThreadsPerCore=1 RealMemory=256000 '
                         f'Gres=gpu:8 Features=v100-32g,a100,h100 State=UNKNOWN')
        lines.append('PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP')
        with open(self.conf, 'w') as f:
            f.write('\n'.join(lines) + '\n')
        with open(os.path.join(d, 'gres.conf'), 'w') as f:
            f.write('\n'.join(gres) + '\n')

    def _hosts(self, add):
        with open('/etc/hosts') as f:
            kept = [line for line in f if HOSTS_TAG not in line]
        if add:
            kept.append(f'127.0.0.1 {" ".join(NODES)} {HOSTS_TAG}\n')
        with open('/etc/hosts', 'w') as f:
            f.writelines(kept)

    def _start_munge(self):
        if subprocess.run('munge -n | unmunge', shell=True, capture_output=True).returncode == 0:
            return  # a munged is already serving: not ours to start or stop
        if not os.path.exists('/etc/munge/munge.key'):
            subprocess.run(['mungekey', '--create'], check=True)
            shutil.chown('/etc/munge/munge.key', 'munge', 'munge')
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
        self._hosts(add=False)
