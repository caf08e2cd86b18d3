"""The emulated cluster: up, exec, shaped inter-node vs unshaped intra-node traffic, launch, rollback, down.

Needs root and iproute2 (`ip`, `tc`); skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from specs.errors import PlannerError
from runners import netns_cluster as nc

from tests.integration.netns_support import netns_skip_reason

PREFIX = "pltest"


def _skip_reason() -> str | None:
    return netns_skip_reason(PREFIX)


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_CLUSTER_STATE_DIR", str(tmp_path))
    nc.down(prefix=PREFIX)
    yield tmp_path
    nc.down(prefix=PREFIX)


def _leftovers() -> list[str]:
    return nc.list_namespaces(PREFIX)


RATE_BITS = 200e6
# Receiver in node 0 counts bytes; sender pushes 8 MiB and reports the rate the receiver saw.
RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1); c, _ = s.accept(); n = 0; t = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t = t or time.perf_counter(); n += len(b)
print(n * 8 / (time.perf_counter() - t))
"""
SENDER = """
import socket, sys, time
for _ in range(100):
    try: c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
buf = b"x" * (1 << 20)
for _ in range(8): c.sendall(buf)
c.close()
"""


def _measure_bits_per_s(state: nc.ClusterState, *, sender_node: int, port: int) -> float:
    receiver = subprocess.Popen(nc.exec_argv(state, 0, [sys.executable, "-c", RECEIVER, str(port)]),
                                stdout=subprocess.PIPE, text=True)
    subprocess.run(nc.exec_argv(state, sender_node, [sys.executable, "-c", SENDER, state.address(0), str(port)]),
                   check=True, timeout=60)
    out, _ = receiver.communicate(timeout=60)
    return float(out.strip())


def test_up_exec_shaping_and_down_leave_nothing_behind(state_dir) -> None:
    state = nc.up(num_nodes=2, procs_per_node=2, inter_node_bandwidth="200mbit", inter_node_latency=None, prefix=PREFIX)
    assert (state_dir / f"cluster-{PREFIX}.json").exists()
    assert sorted(_leftovers()) == [f"{PREFIX}-hub", f"{PREFIX}-n0", f"{PREFIX}-n1"]
    info = nc.status(prefix=PREFIX)
    assert info["hub_up"] and all(n["up"] for n in info["nodes"])
    # Each node sees only its own NIC address; the root namespace never gets one.
    addr = subprocess.run(nc.exec_argv(state, 1, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]),
                          capture_output=True, text=True, check=True).stdout
    assert "10.77.0.2/24" in addr
    assert "10.77.0." not in subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    env = subprocess.run(nc.exec_argv(state, 1, ["sh", "-c", "echo $GLOO_SOCKET_IFNAME $MASTER_ADDR"]),
                         capture_output=True, text=True, check=True).stdout.split()
    assert env == ["eth0", "10.77.0.1"]
    inter = _measure_bits_per_s(state, sender_node=1, port=5601)
    intra = _measure_bits_per_s(state, sender_node=0, port=5602)
    # TCP/IP headers take ~4% of a 1500-byte frame, so the payload rate sits a little under the shaped rate.
    assert 0.8 * RATE_BITS < inter < 1.05 * RATE_BITS
    assert intra > 5 * RATE_BITS
    assert sorted(nc.down(prefix=PREFIX)) == [f"{PREFIX}-hub", f"{PREFIX}-n0", f"{PREFIX}-n1"]
    assert _leftovers() == [] and not (state_dir / f"cluster-{PREFIX}.json").exists()
    assert nc.down(prefix=PREFIX) == []


def test_launch_on_cluster_kills_every_node_when_one_fails(state_dir) -> None:
    state = nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)
    lines: list[tuple[int, str]] = []
    start = time.monotonic()
    code = nc.launch_on_cluster(state, [
        ["sh", "-c", "echo node0 $PLANNER_CLUSTER_NODE; sleep 60"],
        ["sh", "-c", "echo node1 $PLANNER_CLUSTER_NODE; sleep 0.5; exit 3"],
    ], on_line=lambda node, line: lines.append((node, line)))
    assert code == 3 and time.monotonic() - start < 20
    assert (0, "node0 0") in lines and (1, "node1 1") in lines
    assert nc.namespace_pids(state.namespace(0)) == [] and nc.namespace_pids(state.namespace(1)) == []
    ok = nc.launch_on_cluster(state, [["true"], ["true"]], on_line=lambda node, line: None)
    assert ok == 0


def test_failed_setup_is_rolled_back_with_the_reason(state_dir, monkeypatch) -> None:
    monkeypatch.setattr(nc, "_shape_commands", lambda state, node: [["tc", "-n", state.namespace(node), "qdisc",
                                                                      "add", "dev", "eth0", "root", "nosuchqdisc"]])
    with pytest.raises(PlannerError, match="rolled back.*nosuchqdisc"):
        nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth="1gbit", inter_node_latency=None, prefix=PREFIX)
    assert _leftovers() == [] and not (state_dir / f"cluster-{PREFIX}.json").exists()


def test_down_after_a_crash_cleans_up_by_prefix(state_dir) -> None:
    state = nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)
    orphan = subprocess.Popen(nc.exec_argv(state, 1, ["sleep", "300"]), start_new_session=True)
    (state_dir / f"cluster-{PREFIX}.json").unlink()  # the crash lost the state file
    with pytest.raises(PlannerError, match="already up"):
        nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)
    assert len(nc.down(prefix=PREFIX)) == 3
    assert orphan.wait(timeout=10) != 0 and _leftovers() == []


def test_bad_cluster_input(monkeypatch) -> None:
    with pytest.raises(PlannerError, match="bad rate '1 gigabit'"):
        nc.parse_rate_bits_per_s("1 gigabit")
    with pytest.raises(PlannerError, match="bad time"):
        nc.parse_time_s("1 fortnight")
    assert nc.parse_rate_bits_per_s("125mbps") == pytest.approx(1e9)
    assert nc.parse_time_s("1ms") == pytest.approx(1e-3)
    with pytest.raises(PlannerError, match="--nodes must be between 1 and 250"):
        nc.up(num_nodes=0, procs_per_node=1, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)
    monkeypatch.setattr(nc.os, "geteuid", lambda: 1000)
    with pytest.raises(PlannerError, match="needs root"):
        nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)


PING = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
print(sorted(rtts)[10])
"""
ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1); c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)): c.sendall(b)
"""


def test_latency_is_emulated_where_the_kernel_has_netem(state_dir) -> None:
    state = nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth="1gbit", inter_node_latency="5ms", prefix=PREFIX)
    if not state.latency_emulated:
        pytest.skip("this kernel has no sch_netem (CONFIG_NET_SCH_NETEM): latency cannot be emulated")
    echo = subprocess.Popen(nc.exec_argv(state, 0, [sys.executable, "-c", ECHO, "5603"]))
    time.sleep(0.5)
    out = subprocess.run(nc.exec_argv(state, 1, [sys.executable, "-c", PING, state.address(0), "5603"]),
                         capture_output=True, text=True, check=True, timeout=60).stdout
    echo.wait(timeout=10)
    # One-way delay on each node's egress: a round trip crosses it twice.
    assert 2 * 5e-3 <= float(out) < 2 * 5e-3 + 5e-3


def test_profile_on_the_cluster_recovers_the_shaped_rate_and_names_a_failed_rank(state_dir, monkeypatch) -> None:
    from profilers.profile import ProfileOptions, run_profile
    from runners.launch import RunFailed

    nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth="200mbit", inter_node_latency=None, prefix=PREFIX)
    options = ProfileOptions(quick=True, cluster_prefix=PREFIX, collectives=("p2p", "all_reduce"),
                             sizes_bytes=(4096, 65536, 1 << 20, 4 << 20, 8 << 20), probe_seconds=0.3)
    hw = run_profile(options)
    # Gloo binds eth0 in each namespace, so the one-rank-per-node group crosses the shaped veth.
    assert {(f.collective, f.link) for f in hw.collectives} == {("p2p", "inter_node"), ("all_reduce", "inter_node")}
    assert hw.inter_node.bandwidth_bytes_per_s == pytest.approx(RATE_BITS / 8, rel=0.15)
    monkeypatch.setenv("PLANNER_PROFILE_FAIL_RANK", "1")
    with pytest.raises(RunFailed, match="rank 1 .*injected failure"):
        run_profile(options)
    assert nc.namespace_pids(f"{PREFIX}-n0") == [] and nc.namespace_pids(f"{PREFIX}-n1") == []


def test_cluster_cli_up_status_exec_down(state_dir) -> None:
    import json

    from typer.testing import CliRunner

    from planner.cli import app

    cli = CliRunner()
    up = cli.invoke(app, ["cluster", "up", "--nodes", "2", "--procs-per-node", "1", "--inter-node-bandwidth",
                          "1gbit", "--prefix", PREFIX, "--format", "json"])
    assert up.exit_code == 0, up.output
    assert json.loads(up.output)["inter_node_bandwidth_bits_per_s"] == 1e9
    status = json.loads(cli.invoke(app, ["cluster", "status", "--prefix", PREFIX, "--format", "json"]).output)
    assert [n["address"] for n in status["nodes"]] == ["10.77.0.1", "10.77.0.2"]
    # exec's exit code is the command's: the node's address is there, the other node's is not local.
    assert cli.invoke(app, ["cluster", "exec", "--node", "1", "--prefix", PREFIX, "--", "sh", "-c",
                            "ip -4 addr show dev eth0 | grep -q 10.77.0.2"]).exit_code == 0
    assert cli.invoke(app, ["cluster", "exec", "--node", "1", "--prefix", PREFIX, "--", "sh", "-c",
                            "exit 7"]).exit_code == 7
    bad = cli.invoke(app, ["cluster", "exec", "--node", "5", "--prefix", PREFIX, "--", "true"])
    assert isinstance(bad.exception, PlannerError) and "--node must be between 0 and 1" in str(bad.exception)
    down = cli.invoke(app, ["cluster", "down", "--prefix", PREFIX])
    assert down.exit_code == 0 and f"{PREFIX}-hub" in down.output and _leftovers() == []
    assert "nothing to remove" in cli.invoke(app, ["cluster", "down", "--prefix", PREFIX]).output


def test_validate_runs_plans_across_the_emulated_nodes(state_dir, tmp_path) -> None:
    """planner validate --cluster: every plan (and the batched timing run) crosses the namespaces, priced
    for the cluster's 2 nodes x 1 process; a plan that cannot run there is reported, not fatal."""
    import json

    from typer.testing import CliRunner

    from planner.cli import app

    nc.up(num_nodes=2, procs_per_node=1, inter_node_bandwidth="200mbit", inter_node_latency=None, prefix=PREFIX)
    out = tmp_path / "validate.json"
    result = CliRunner().invoke(app, ["validate", "--cluster", "--cluster-prefix", PREFIX, "--top", "1",
                                      "--max-plans", "3", "--steps", "3", "--timing-rounds", "1",
                                      "--global-batch", "4", "--out", str(out), "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["cluster"] == PREFIX and report["nproc"] == 2 and report["num_plans"] == 3
    ok = [r for r in report["plans"] if r["status"] == "ok"]
    assert ok and all(r["measured_step_time_s"] > 0 and r["batched_step_times_s"] for r in ok)
    assert all(r["plan"]["dp"] * r["plan"]["tp"] * r["plan"]["pp"] == 2 for r in report["plans"])
    assert nc.namespace_pids(f"{PREFIX}-n0") == [] and nc.namespace_pids(f"{PREFIX}-n1") == []


# ZeRO-3 over both nodes (all-gathers and gloo's reduce-scatter), DP pairs across nodes under TP inside
# them (all-reduce), and a pipeline whose stages sit on different nodes (p2p); tiny model, dp4 / tp2 x dp2
# / pp2 x dp2 on 2 nodes x 2 processes.
WIRE_PLANS = (dict(dp=4, param_shard=4, grad_shard=4, optim_shard=4, micro_batch=1, num_micro_batches=2),
              dict(dp=2, tp=2, micro_batch=1, num_micro_batches=2),
              dict(dp=2, pp=2, micro_batch=1, num_micro_batches=4))


def _wire_run(state: nc.ClusterState, *, steps: int) -> tuple[int, int, list[dict]]:
    """(bytes, packets) the run put on the inter-node link (the nodes' NIC tx counters), and each plan's
    modelled comm_bytes per step; one launch trains every plan of WIRE_PLANS in turn."""
    from runners.launch import Where, run_workers
    from tests.distributed.harness import tiny_config
    from specs.plan import Plan

    cfgs = [tiny_config(Plan(**p), steps=steps, ranks_per_node=state.procs_per_node).to_dict() for p in WIRE_PLANS]
    before = nc.link_counters(state)
    runs = run_workers("runners.train", {"runs": cfgs}, where=Where(cluster=state.prefix))["runs"]
    deltas = [a - b for a, b in zip(nc.link_counters(state), before)]
    return sum(d.tx_bytes for d in deltas), sum(d.tx_packets for d in deltas), [r["summary"]["comm_bytes"] for r in runs]


def test_bytes_on_the_veths_match_the_modelled_wire_bytes(state_dir) -> None:
    """The bytes that crossed the emulated network, read from every node NIC's kernel counters around two
    runs of the same plans (1 and 3 steps: their difference drops the start-up, rendezvous and metrics),
    against the engine's modelled inter-node bytes of those 2 steps. The modelled wire bytes count gloo's
    reduce-scatter as the all-reduce it is (runners/comm.py); the ring volume ("inter_node") is short by
    exactly that. The rest is protocol: 66 B of Ethernet, IP and TCP headers per packet (veth hands over
    GSO segments of up to 64 KiB, so 0.3-1.3% here) and TCP acknowledgements."""
    state = nc.up(num_nodes=2, procs_per_node=2, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)
    short_bytes, short_packets, _ = _wire_run(state, steps=1)
    long_bytes, long_packets, modelled = _wire_run(state, steps=3)
    measured, packets = long_bytes - short_bytes, long_packets - short_packets
    wire = 2 * sum(m["inter_node_wire"] for m in modelled)
    ring = 2 * sum(m["inter_node"] for m in modelled)
    reduce_scatter = 2 * modelled[0]["reduce_scatter"]  # ZeRO-3's, half of it across the nodes
    assert wire == pytest.approx(ring + reduce_scatter / 2, rel=1e-6)
    overhead = measured - wire
    numbers = f"measured {measured} B in {packets} packets, modelled wire {wire} B, ring {ring} B"
    assert 0 <= overhead <= 0.03 * wire and overhead <= 200 * packets, numbers
    assert measured > 1.2 * ring, numbers  # the ring model misses a quarter of what gloo's ZeRO-3 moves
