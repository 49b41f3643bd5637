"""Simulated hosts on one machine: H network namespaces, each a "host" with its own network
interface, its own /dev/shm and its own launcher, joined through a switch by links shaped with
tbf. The test bed of the many-hosts tests and of `phalanx bench hosts`.

Each host is a namespace `<prefix>-h<i>` holding `eth0` (10.77.0.<i+1>/24), one end of a veth
pair whose other end sits on a bridge in the switch namespace `<prefix>-sw`; nothing is added to
the machine's own namespace. With `link_gbit` both directions of every host's link are shaped
with a token bucket (`tc qdisc ... tbf rate R`, on eth0 for what a host sends and on the switch
port for what it receives). This kernel has tbf and htb but no netem, so latency cannot be added:
links are as fast to answer as loopback, and only their bandwidth is a real link's. MTU 9000
(jumbo frames) keeps the headers under 1% of what the counters count.

A host's processes start through `popen(host, argv)`: inside its namespace, with a private
tmpfs mounted on /dev/shm (a mount namespace of their own: a real host cannot see another's
shared memory, and neither can these), which stays visible from outside at `shm_dir(host)` so a
test can check what is left in it. `tx_bytes(host)` reads the host's
/sys/class/net/eth0/statistics/tx_bytes: the bytes it put on its link.

Needs root and iproute2 (`bed_unavailable()` says why not, in one phrase). Everything it makes
carries the prefix `phxbed-<pid>-<n>`; `close()` (or leaving the `with`) kills the processes it
started, unmounts and removes every directory, link and namespace, however the caller ends; a
new bed first removes what a dead process's bed left (its pid no longer runs). A host's /dev/shm
directory in /tmp gets a random suffix (mkdtemp), and the sweep unmounts only real directories of
this user's: another user's link at a dead bed's name (`phxbed-<pid>-0-h0-shm -> /dev/shm`) had
`umount -l` follow it and take that mount away from every process on the machine.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

from phalanx.runtime.procs import process_alive

PREFIX = "phxbed"
SUBNET = "10.77.0"
INTERFACE = "eth0"
MTU = 9000
SHM_MB = 512  # each host's /dev/shm: segments of 4 workers at the default slot with room to spare
_COUNTER = itertools.count()
_STALE = re.compile(rf"^{PREFIX}-(\d+)-")


class BedError(RuntimeError):
    """The bed could not be set up (a command of iproute2 or mount failed)."""


def bed_unavailable() -> str | None:
    """None when this machine can hold a bed, else why not (one phrase)."""
    if not os.path.isdir("/proc/self/ns"):
        return "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"simulated hosts need iproute2 and util-linux ({tool} is not on PATH)"
    missing = [name for name, bit in (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21)) if not _capabilities() >> bit & 1]
    if missing:  # a container's root without them cannot make namespaces, links or mounts
        return f"simulated hosts need {' and '.join(missing)}, which this process lacks (a container's root?)"
    return None


def _capabilities() -> int:
    """This process's effective capabilities (/proc/self/status's CapEff), 0 if unreadable."""
    try:
        with open("/proc/self/status") as status:
            line = next((line for line in status if line.startswith("CapEff:")), "CapEff: 0")
    except OSError:
        return 0
    return int(line.split()[1], 16)


def host_address(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise BedError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")


class HostsBed:
    """`hosts` simulated hosts, links of `link_gbit` Gbit/s each way (None: unshaped)."""

    def __init__(self, *, hosts: int, link_gbit: float | None = None) -> None:
        if hosts < 1 or hosts > 200:
            raise ValueError(f"a bed holds 1 to 200 hosts, got {hosts}")
        if link_gbit is not None and not link_gbit > 0:
            raise ValueError(f"link speed must be a positive number of Gbit/s (or None), got {link_gbit}")
        self.hosts, self.link_gbit = hosts, link_gbit
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}"
        self._namespaces: list[str] = []
        self._mounts: list[Path] = []
        self._shm_dirs: dict[int, Path] = {}
        self._procs: list[subprocess.Popen] = []

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def shm_dir(self, host: int) -> Path:
        """Host `host`'s /dev/shm, as seen from outside its namespace (made when the bed is built)."""
        return self._shm_dirs[host]

    def __enter__(self) -> "HostsBed":
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        switch = f"{self.prefix}-sw"
        self._add_namespace(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for host in range(self.hosts):
            ns, port = self.namespace(host), f"p{host}"
            self._add_namespace(ns)
            _run("ip", "link", "add", INTERFACE, "netns", ns, "mtu", str(MTU), "type", "veth",
                 "peer", "name", port, "netns", switch, "mtu", str(MTU))
            _run("ip", "-n", ns, "addr", "add", f"{host_address(host)}/24", "dev", INTERFACE)
            _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            if self.link_gbit is not None:
                for where, dev in ((ns, INTERFACE), (switch, port)):
                    _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", *tbf_args(self.link_gbit))
            # A fresh name: another user cannot have put a file or link there first.
            shm = self._shm_dirs[host] = Path(tempfile.mkdtemp(prefix=f"{ns}-shm-"))
            self._mounts.append(shm)
            _run("mount", "-t", "tmpfs", "-o", f"size={SHM_MB}m,mode=1777", "tmpfs", str(shm))

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on host `host` (its namespace, its /dev/shm), in a session of its own;
        `kwargs` go to Popen (env, stdout, ...). `close()` kills it and what it started."""
        shell = 'mount --bind "$0" /dev/shm && exec "$@"'
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), "sh", "-c", shell,
                                 str(self.shm_dir(host)), *argv], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def tx_bytes(self, host: int) -> int:
        """The bytes host `host` has sent on its link so far (its eth0's counter)."""
        done = subprocess.run(["ip", "netns", "exec", self.namespace(host), "cat",
                               f"/sys/class/net/{INTERFACE}/statistics/tx_bytes"], capture_output=True, text=True)
        if done.returncode != 0:
            raise BedError(f"cannot read host {host}'s counter: {done.stderr.strip()}")
        return int(done.stdout)

    def close(self) -> None:
        """Kill what it started, then remove its mounts, directories and namespaces; safe twice."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        self._procs = []
        for shm in self._mounts:
            _unmount(shm)
        self._mounts = []
        for name in reversed(self._namespaces):  # a namespace takes its links with it
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        self._namespaces = []


def tbf_args(link_gbit: float) -> list[str]:
    """A token bucket of `link_gbit` Gbit/s: bursts of 2 ms of the rate (at least 64 KiB, and a
    jumbo frame), a queue of 50 ms."""
    rate_Bps = link_gbit * 1e9 / 8
    burst = max(64 << 10, int(rate_Bps * 2e-3), 2 * MTU)
    return ["tbf", "rate", f"{link_gbit * 1000:g}mbit", "burst", str(burst), "latency", "50ms"]


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
    try:
        path.rmdir()
    except OSError:
        pass


def remove_stale() -> list[str]:
    """Remove the namespaces and /dev/shm mounts of beds whose process no longer runs; their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        match = _STALE.match(name)
        if match and not process_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-shm*"):
        match = _STALE.match(path.name)
        if match and not process_alive(int(match.group(1))) and _own_directory(path):
            _unmount(path)
            removed.append(str(path))
    return removed


def _own_directory(path: Path) -> bool:
    """Whether `path` itself (not what a link names) is a directory of this user's."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid()
