"""An emulated multi-node cluster on one Linux host: network namespaces as nodes, tc-shaped links between.

    planner cluster up --nodes 2 --procs-per-node 2 --inter-node-bandwidth 1gbit --inter-node-latency 1ms
    planner cluster exec --node 1 -- ip addr
    planner cluster down

Layout (nothing is created in the root namespace): a hub namespace `<prefix>-hub` holds a bridge `br0`;
each node is a namespace `<prefix>-n<i>` with loopback up and a veth `eth0` (address 10.77.0.<i+1>/24)
whose peer `n<i>` sits on the hub's bridge. The node's NIC is shaped in both directions: the node-side
egress (leaving the node) by netem delay (where the kernel has sch_netem) then a token bucket, the
hub-side egress (entering the node) by a token bucket. Processes of one node run inside its namespace;
gloo/NCCL bind to `eth0` (GLOO_SOCKET_IFNAME), and traffic to the node's own address goes over the
namespace's loopback, so intra-node traffic is unshaped and inter-node traffic crosses the shaped veth.

`--inter-node-bandwidth` is the node's NIC, shared by its processes: `planner profile` measures each
group alone (one rank per node), so its inter_node link reads this rate; ranks of one node that cross
nodes at the same time split it (real GPU nodes usually have a NIC rail per GPU instead).

State lives in a JSON file; `down` deletes every namespace named with the prefix (and with them their
veths, bridge and qdiscs) and the processes inside them, so it also cleans up after a crash.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from runners.interrupts import interrupt_deferred
from specs.errors import PlannerError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "planner"
SUBNET_PREFIX = "10.77.0."  # private addresses, used only inside namespaces this module creates
NODE_IFNAME = "eth0"
MASTER_PORT = 29517


@dataclass(frozen=True)
class ClusterState:
    prefix: str
    num_nodes: int
    procs_per_node: int
    inter_node_bandwidth_bits_per_s: float | None
    inter_node_latency_s: float
    # False where the kernel has no sch_netem: the link is rate-limited but adds no delay.
    latency_emulated: bool

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET_PREFIX}{node + 1}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def state_path(prefix: str = DEFAULT_PREFIX) -> Path:
    base = Path(os.environ.get("PLANNER_CLUSTER_STATE_DIR", "/run/planner"))
    return base / f"cluster-{prefix}.json"


def load_state(prefix: str = DEFAULT_PREFIX) -> ClusterState:
    path = state_path(prefix)
    try:
        data = json.loads(path.read_text())
        return ClusterState(**data)
    except FileNotFoundError:
        raise PlannerError(f"no emulated cluster is up (no state file {path}); run `planner cluster up`") from None
    except (json.JSONDecodeError, TypeError) as exc:
        raise PlannerError(f"cluster state file {path} is corrupt ({exc}); run `planner cluster down`") from None


# --- unit parsing -----------------------------------------------------------------------------------
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate_bits_per_s(text: str) -> float:
    """tc-style rate ('1gbit', '100mbit', '125mbps' = bytes) to bits per second."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in _RATE_UNITS:
        raise PlannerError(f"bad rate {text!r}: use a number and one of {', '.join(_RATE_UNITS)} (e.g. 1gbit)")
    value = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if value <= 0:
        raise PlannerError(f"rate must be positive, got {text!r}")
    return value


def parse_time_s(text: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us)\s*", text)
    if not match:
        raise PlannerError(f"bad time {text!r}: use a number and s, ms or us (e.g. 1ms)")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


# --- commands ---------------------------------------------------------------------------------------
def _run(argv: Sequence[str]) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def check_prerequisites() -> None:
    """Root and iproute2 (`ip`, `tc`); raise PlannerError naming what is missing."""
    if os.geteuid() != 0:
        raise PlannerError("the emulated cluster needs root (network namespaces and tc); run as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise PlannerError(f"missing {', '.join(missing)}: install iproute2 (apt-get install -y iproute2)")


def list_namespaces(prefix: str) -> list[str]:
    """Namespaces this module made under `prefix` (hub and nodes), from `ip netns list`."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    pattern = re.compile(rf"{re.escape(prefix)}-(hub|n\d+)")
    return [name for name in (line.split()[0] for line in out.splitlines() if line.strip())
            if pattern.fullmatch(name)]


def namespace_pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_pids(pids: Sequence[int], *, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after `grace_s`."""
    alive = [p for p in pids if _signal(p, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _exists(p)]
    for pid in alive:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _has_netem(namespace: str) -> bool:
    """Whether this kernel has sch_netem (many container kernels do not): try it on the hub's loopback."""
    probe = subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return True
    return False


def _tbf(namespace: str, dev: str, *, rate_bits_per_s: float, parent: Sequence[str]) -> list[str]:
    # Burst: one millisecond of traffic and at least one 64 KiB GSO segment, so the bucket never has to
    # split the large packets veth hands it; the 50 ms queue keeps TCP from dropping at line rate.
    burst_bytes = max(64 * 1024, int(rate_bits_per_s / 8 * 1e-3))
    return ["tc", "-n", namespace, "qdisc", "add", "dev", dev, *parent, "tbf",
            "rate", f"{int(rate_bits_per_s)}bit", "burst", str(burst_bytes), "latency", "50ms"]


def _shape_commands(state: ClusterState, node: int) -> list[list[str]]:
    if state.inter_node_bandwidth_bits_per_s is None and not state.latency_emulated:
        return []
    ns = state.namespace(node)
    rate = state.inter_node_bandwidth_bits_per_s
    cmds = []
    if state.latency_emulated:
        cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", NODE_IFNAME, "root", "handle", "1:", "netem",
                     "delay", f"{state.inter_node_latency_s * 1e6:.0f}us", "limit", "100000"])
        if rate:
            cmds.append(_tbf(ns, NODE_IFNAME, rate_bits_per_s=rate, parent=["parent", "1:1", "handle", "10:"]))
    elif rate:
        cmds.append(_tbf(ns, NODE_IFNAME, rate_bits_per_s=rate, parent=["root"]))
    if rate:
        cmds.append(_tbf(state.hub, f"n{node}", rate_bits_per_s=rate, parent=["root"]))
    return cmds


def up(*, num_nodes: int, procs_per_node: int, inter_node_bandwidth: str | None, inter_node_latency: str | None,
       prefix: str = DEFAULT_PREFIX) -> ClusterState:
    """Create the namespaces, bridge, veths and shaping; on any failure roll everything back and say why."""
    check_prerequisites()
    if num_nodes < 1 or num_nodes > 250:
        raise PlannerError(f"--nodes must be between 1 and 250, got {num_nodes}")
    if procs_per_node < 1:
        raise PlannerError(f"--procs-per-node must be at least 1, got {procs_per_node}")
    if state_path(prefix).exists() or list_namespaces(prefix):
        raise PlannerError(f"an emulated cluster {prefix!r} is already up; run `planner cluster down` first")
    rate = parse_rate_bits_per_s(inter_node_bandwidth) if inter_node_bandwidth else None
    latency_s = parse_time_s(inter_node_latency) if inter_node_latency else 0.0
    hub = f"{prefix}-hub"
    try:
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        netem = latency_s > 0 and _has_netem(hub)
        if latency_s > 0 and not netem:
            log.warning("this kernel has no sch_netem (CONFIG_NET_SCH_NETEM): inter-node links are rate-limited "
                        "but the %.3g ms latency is not emulated", latency_s * 1e3)
        state = ClusterState(prefix=prefix, num_nodes=num_nodes, procs_per_node=procs_per_node,
                             inter_node_bandwidth_bits_per_s=rate, inter_node_latency_s=latency_s,
                             latency_emulated=netem)
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        for node in range(num_nodes):
            ns = state.namespace(node)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", hub, "link", "add", f"n{node}", "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns])
            _run(["ip", "-n", hub, "link", "set", f"n{node}", "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{state.address(node)}/24", "dev", NODE_IFNAME])
            _run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            for cmd in _shape_commands(state, node):
                _run(cmd)
        path = state_path(prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state.to_dict(), indent=2))
    except (RuntimeError, OSError) as exc:
        down(prefix=prefix)
        raise PlannerError(f"cluster setup failed and was rolled back: {exc}") from None
    return state


def down(*, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Kill the processes inside the cluster's namespaces, delete the namespaces and the state file.

    Idempotent and driven by the name prefix, not the state file, so it also cleans up after a crash.
    Returns the namespaces it removed.
    """
    namespaces = list_namespaces(prefix)
    for ns in namespaces:
        _kill_pids(namespace_pids(ns))
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    state_path(prefix).unlink(missing_ok=True)
    return namespaces


def status(*, prefix: str = DEFAULT_PREFIX) -> dict:
    """The recorded state, whether each namespace exists, and how many processes run in it."""
    state = load_state(prefix)
    present = set(list_namespaces(prefix))
    nodes = [{"node": i, "namespace": state.namespace(i), "address": state.address(i),
              "up": state.namespace(i) in present,
              "num_processes": len(namespace_pids(state.namespace(i))) if state.namespace(i) in present else 0}
             for i in range(state.num_nodes)]
    return {**state.to_dict(), "hub_up": state.hub in present, "nodes": nodes}


# --- measured traffic ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkCounters:
    """A node NIC's kernel counters (its veth `eth0`): what crossed the emulated network, headers included."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: "LinkCounters") -> "LinkCounters":
        return LinkCounters(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def link_counters(state: ClusterState) -> list[LinkCounters]:
    """Every node's NIC counters now (`ip -n <node> -s -j link show eth0`); read them around a run, and
    the difference is the traffic the run put on the emulated network: every byte that leaves a node is
    one node's tx (and the other's rx), so the sum of tx over nodes counts each byte once. Intra-node
    traffic never reaches eth0 (the node's own address routes over its loopback)."""
    counters = []
    for node in range(state.num_nodes):
        (link,) = json.loads(_run(["ip", "-n", state.namespace(node), "-s", "-j", "link", "show", "dev", NODE_IFNAME]))
        stats = link["stats64"]
        counters.append(LinkCounters(tx_bytes=stats["tx"]["bytes"], rx_bytes=stats["rx"]["bytes"],
                                     tx_packets=stats["tx"]["packets"], rx_packets=stats["rx"]["packets"]))
    return counters


# --- running inside nodes ---------------------------------------------------------------------------
def node_env(state: ClusterState, node: int) -> dict[str, str]:
    """Environment for a process in `node`: bind gloo/NCCL to the node's NIC, and where node 0 listens."""
    return {"GLOO_SOCKET_IFNAME": NODE_IFNAME, "NCCL_SOCKET_IFNAME": NODE_IFNAME,
            "PLANNER_CLUSTER_NODE": str(node), "PLANNER_CLUSTER_NNODES": str(state.num_nodes),
            "MASTER_ADDR": state.address(0), "MASTER_PORT": str(MASTER_PORT)}


def torchrun_argv(state: ClusterState, node: int, module_argv: Sequence[str], *, port: int = MASTER_PORT) -> list[str]:
    """`python -m torch.distributed.run` for one node, rendezvousing (static) on node 0's address."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(state.num_nodes),
            "--node-rank", str(node), "--nproc-per-node", str(state.procs_per_node),
            "--rdzv-backend", "static", "--rdzv-endpoint", f"{state.address(0)}:{port}",
            "--master-addr", state.address(0), "--master-port", str(port), *module_argv]


def elastic_torchrun_argv(state: ClusterState, node: int, module_argv: Sequence[str], *, nodes: tuple[int, int],
                          max_restarts: int, port: int = MASTER_PORT) -> list[str]:
    """`python -m torch.distributed.run` for one node of an elastic run (runners/elastic.py): c10d
    rendezvous hosted by node 0's agent; each node names its own address (the namespaces share one host
    name, which would resolve to none of them)."""
    from runners.elastic import torchrun_elastic_args

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(state.procs_per_node),
            *torchrun_elastic_args(nodes=nodes, endpoint=f"{state.address(0)}:{port}", run_id=state.prefix,
                                   max_restarts=max_restarts, is_host=node == 0, local_addr=state.address(node)),
            *module_argv]


def exec_argv(state: ClusterState, node: int, argv: Sequence[str]) -> list[str]:
    if not 0 <= node < state.num_nodes:
        raise PlannerError(f"--node must be between 0 and {state.num_nodes - 1}, got {node}")
    env = [f"{k}={v}" for k, v in node_env(state, node).items()]
    return ["ip", "netns", "exec", state.namespace(node), "env", *env, *argv]


def _descendants(root_pid: int) -> list[int]:
    """`root_pid` and every process below it, from /proc (torchrun puts its workers in new sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def kill_process_tree(root_pid: int, *, grace_s: float = 3.0) -> None:
    """SIGTERM `root_pid` and all its descendants (collected first, before any re-parenting), then SIGKILL."""
    _kill_pids(_descendants(root_pid), grace_s=grace_s)


def launch_on_cluster(state: ClusterState, argv_per_node: Sequence[Sequence[str]], *,
                      env: dict[str, str] | None = None,
                      on_line: Callable[[int, str], None] | None = None) -> int:
    """Run argv_per_node[i] inside node i's namespace, stream their output, and return the exit code.

    Output lines go to `on_line(node, line)` (default: stdout prefixed with the node). When one node's
    command fails, or on Ctrl-C, every process started here (and its descendants) is terminated; the
    first failing exit code is returned (130 for Ctrl-C).
    """
    if len(argv_per_node) != state.num_nodes:
        raise PlannerError(f"need one command per node ({state.num_nodes}), got {len(argv_per_node)}")
    emit = on_line or (lambda node, line: print(f"[n{node}] {line}", flush=True))
    procs: list[subprocess.Popen] = []
    threads = []
    try:
        for node, argv in enumerate(argv_per_node):
            with interrupt_deferred():  # a Ctrl-C inside Popen would leave a started node out of `procs`
                procs.append(subprocess.Popen(exec_argv(state, node, argv), env={**os.environ, **(env or {})},
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              bufsize=1, start_new_session=True))
            proc = procs[-1]
            thread = threading.Thread(target=_pump, args=(proc, node, emit), daemon=True)
            thread.start()
            threads.append(thread)
        code = _wait_all(procs)
    except KeyboardInterrupt:
        code = 130
    if code != 0:
        _terminate(procs)
    for thread in threads:
        thread.join(timeout=5)
    return code


def _pump(proc: subprocess.Popen, node: int, emit: Callable[[int, str], None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        emit(node, line.rstrip("\n"))


def _wait_all(procs: list[subprocess.Popen]) -> int:
    """0 when all exit cleanly; the first non-zero code as soon as any process fails."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _terminate(procs: list[subprocess.Popen]) -> None:
    pids = [pid for p in procs if p.poll() is None for pid in _descendants(p.pid)]
    _kill_pids(pids)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()


# --- elastic runs: nodes may leave and come back ------------------------------------------------------------
class ElasticNodes:
    """The node processes of an elastic run on the emulated cluster, and the faults a test or benchmark
    injects into them: `kill` (every process of the node SIGKILLed: a power loss; its sockets close),
    `cut_off` (its link down: nothing closes, peers can only time out) and `rejoin` (link up, and the
    node's torchrun started again, as a node that comes back runs its job's command again).

    Unlike `launch_on_cluster`, a node other than node 0 that exits ends nothing: the others go on
    (torchrun's elastic rendezvous shrinks the world). Node 0 hosts the rendezvous; its exit code is the
    run's, and when it fails every node is stopped.
    """

    def __init__(self, state: ClusterState, argv_per_node: Sequence[Sequence[str]], *, env: dict[str, str],
                 emit: Callable[[int, str], None], on_node_exit: Callable[[int, int], None] | None = None) -> None:
        self.state, self.argv, self.env, self.emit = state, [list(a) for a in argv_per_node], env, emit
        self.on_node_exit = on_node_exit
        self.procs: dict[int, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def start(self, node: int) -> None:
        with interrupt_deferred():  # a Ctrl-C inside Popen would leave a started node out of `procs`
            proc = subprocess.Popen(exec_argv(self.state, node, self.argv[node]), env={**os.environ, **self.env},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    start_new_session=True)
            with self.lock:
                self.procs[node] = proc
        thread = threading.Thread(target=_pump, args=(proc, node, self.emit), daemon=True)
        thread.start()
        self.threads.append(thread)

    def kill(self, node: int) -> None:
        for pid in namespace_pids(self.state.namespace(node)):
            _signal(pid, signal.SIGKILL)

    def cut_off(self, node: int) -> None:
        _run(["ip", "-n", self.state.namespace(node), "link", "set", NODE_IFNAME, "down"])

    def rejoin(self, node: int) -> None:
        """Bring a lost node back: stop what is left of it, link up, start its torchrun again."""
        with self.lock:
            old = self.procs.get(node)
        if old is not None and old.poll() is None:
            kill_process_tree(old.pid, grace_s=1.0)
        self.kill(node)
        _run(["ip", "-n", self.state.namespace(node), "link", "set", NODE_IFNAME, "up"])
        self.start(node)

    def run(self) -> int:
        """Start every node and wait for node 0; returns its exit code (130 on Ctrl-C)."""
        try:
            for node in range(self.state.num_nodes):
                self.start(node)
            code = self._wait()
        except KeyboardInterrupt:
            code = 130
        self.stop(grace_s=10.0 if code == 0 else 0.0)
        return code

    def _wait(self) -> int:
        reported: set[int] = set()
        while True:
            with self.lock:
                procs = dict(self.procs)
            for node, proc in procs.items():
                code = proc.poll()
                if node != 0 and code not in (None, 0) and id(proc) not in reported:
                    reported.add(id(proc))
                    if self.on_node_exit is not None:
                        self.on_node_exit(node, code)
            code = procs[0].poll()
            if code is not None:
                return code
            time.sleep(0.05)

    def stop(self, *, grace_s: float = 10.0) -> None:
        """After node 0 exits: let the other nodes' agents finish (the nodes of the last world end with
        node 0, within a second or two), then stop what is left in every node's namespace (a cut-off
        node's processes too)."""
        deadline = time.monotonic() + grace_s
        with self.lock:
            procs = list(self.procs.values())
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        _terminate(procs)
        for node in range(self.state.num_nodes):
            _kill_pids(namespace_pids(self.state.namespace(node)))
        for thread in self.threads:
            thread.join(timeout=5)
