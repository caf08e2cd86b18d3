"""Elastic runs on the emulated cluster: a node lost (killed, cut off, killed in the middle of a checkpoint
write) shrinks the run to the nodes left under the plan searched for them; the node's return grows it
back; no hand work, and every loss and the final parameters equal a chain of runs resumed by hand from
the same steps under the same plans.

Needs root and network namespaces (skipped with the reason otherwise); 2 nodes x 2 processes, the tiny
model; about a minute or two each on a loaded 2-core machine.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.integration.netns_support import netns_skip_reason

PREFIX = "plelastic"


def _skip_reason() -> str | None:
    return netns_skip_reason(PREFIX)


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

STEPS = 60
# The runs that only shrink: the fault comes at step 6 or 7, well before the last step (the ranks may be a
# few steps ahead of the events the fault waits for), and the shrunk run resumes from step 5.
SHRINK_STEPS = 20


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    from runners import netns_cluster as nc

    monkeypatch.setenv("PLANNER_CLUSTER_STATE_DIR", str(tmp_path / "state"))
    nc.down(prefix=PREFIX)
    state = nc.up(num_nodes=2, procs_per_node=2, inter_node_bandwidth=None, inter_node_latency=None, prefix=PREFIX)
    try:
        yield state
    finally:
        nc.down(prefix=PREFIX)


def _elastic_config(checkpoint_dir: Path, *, steps: int = STEPS, timeout_s: float | None = None):
    """The RunConfig `planner run --cluster --elastic 1:2 --hardware cpu` builds (plan table included)."""
    from planner.run_command import RunRequest, build_run

    request = RunRequest(model="tiny", hardware="cpu", global_batch=8, seq_len=64, precision="fp32", steps=steps,
                         seed=3, nproc=2, nnodes=1, checkpoint_dir=str(checkpoint_dir), checkpoint_every=5,
                         max_restarts=3, cluster=PREFIX, elastic="1:2", timeout_s=timeout_s)
    return build_run(request, {}), request.where()


class _Faults:
    """Drives the faults from the launcher's callbacks: `fault(nodes, 1)` once world 4 reports step
    `at_step`, then node 1 rejoins once the shrunk run has started (when `rejoin`)."""

    def __init__(self, fault, *, at_step: int, rejoin: bool) -> None:
        self.fault, self.at_step, self.rejoin = fault, at_step, rejoin
        self.nodes = None
        self.world = 4
        self.fired = self.rejoined = False
        self.changes = []

    def on_nodes(self, nodes) -> None:
        self.nodes = nodes

    def on_step(self, record: dict) -> None:
        if not self.fired and self.world == 4 and record["step"] >= self.at_step:
            self.fired = True
            self.fault(self.nodes, 1)

    def on_change(self, event) -> None:
        self.changes.append(event)
        if event.kind == "replanned":
            self.world = event.world_size
        if event.kind == "resumed" and event.world_size == 2 and self.rejoin and not self.rejoined:
            self.rejoined = True
            # Off the launcher's output thread: starting a node takes a moment.
            threading.Thread(target=self.nodes.rejoin, args=(1,), daemon=True).start()


def _hand_chain(cfg, *, segments: list[tuple[int, int]], tmp_path: Path):
    """Train the same run by hand on local processes: each (world size, last step) segment resumes the
    previous one's checkpoint under the elastic table's plan for that world. Returns (losses by step,
    checkpoint dir).

    The segments run on the distributed tests' gloo processes (tests/distributed/harness.run_plans: forks
    of a server that imported torch once, one intra-op thread each), not through the launcher: the same
    runners.train.train on the same configs, without ten fresh processes importing torch (about 20 s here).
    What the launcher adds around train (events, restarts) is what the elastic run itself checks."""
    from tests.distributed.harness import run_plans

    ckpt = tmp_path / "hand"
    losses = {}
    for i, (world, until) in enumerate(segments):
        seg = cfg.for_world(world).replace(elastic_plans=(), steps=until, checkpoint_dir=str(ckpt), checkpoint_every=0,
                                           resume=i > 0)
        [(metrics, _)] = run_plans([seg])
        losses.update({s.step: s.loss for s in metrics.steps})
    return losses, ckpt


def _final_parameters(checkpoint_dir: Path, tmp_path: Path, name: str) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from runners.checkpoint import find_latest

    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(find_latest(checkpoint_dir), out)
    return {k: v for k, v in torch.load(out).items() if k.startswith("model/")}


def _no_leftovers(state, checkpoint_dir: Path) -> None:
    from runners import netns_cluster as nc

    assert nc.namespace_pids(state.namespace(0)) == [] and nc.namespace_pids(state.namespace(1)) == []
    assert list(checkpoint_dir.glob("*.tmp")) == [] and list(checkpoint_dir.glob("*.old")) == []


def _segments(metrics) -> list[tuple[int, int]]:
    """(world size, step it trained to) of each attempt, from the run's resumed events."""
    resumed = [e for e in metrics.events if e.kind == "resumed"]
    worlds = [4] + [e.world_size for e in resumed]
    ends = [e.step for e in resumed] + [STEPS]
    return list(zip(worlds, ends))


def test_node_killed_shrinks_then_rejoins_and_grows_like_the_hand_resumed_chain(cluster, tmp_path):
    from runners.launch import launch

    cfg, where = _elastic_config(tmp_path / "ckpt")
    assert {w.world_size for w in cfg.elastic_plans} == {2, 4}
    faults = _Faults(lambda nodes, node: nodes.kill(node), at_step=7, rejoin=True)
    metrics = launch(cfg, where=where, on_step=faults.on_step, on_change=faults.on_change, on_nodes=faults.on_nodes,
                     env={"OMP_NUM_THREADS": "1"})
    kinds = [(e.kind, e.world_size) for e in metrics.events]
    assert kinds == [("lost", 4), ("replanned", 2), ("resumed", 2), ("scaled_up", 4), ("replanned", 4),
                     ("resumed", 4)], metrics.events
    shrink, grow = [e for e in metrics.events if e.kind == "resumed"]
    # Resumed from the newest complete checkpoint: nothing older than the last one before the loss.
    done = shrink.step + shrink.steps_lost  # steps done when the node was lost
    assert done > 7 and shrink.step == done // 5 * 5
    assert grow.step % 5 == 0 and grow.step > shrink.step
    assert [s.step for s in metrics.steps] == list(range(STEPS)) and metrics.summary.world_size == 4
    segments = _segments(metrics)
    assert [w for w, _ in segments] == [4, 2, 4]
    hand, hand_ckpt = _hand_chain(cfg, segments=segments, tmp_path=tmp_path)
    for record in metrics.steps:
        assert abs(record.loss - hand[record.step]) <= 1e-5, (record, hand[record.step])
    ours = _final_parameters(tmp_path / "ckpt", tmp_path, "elastic")
    theirs = _final_parameters(hand_ckpt, tmp_path, "hand")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert (ours[key] - theirs[key]).abs().max().item() <= 1e-5, key
    _no_leftovers(cluster, tmp_path / "ckpt")


def _run_with_fault(cfg, where, fault, *, at_step: int, env: dict | None = None):
    from runners.launch import launch

    faults = _Faults(fault, at_step=at_step, rejoin=False)
    metrics = launch(cfg, where=where, on_step=faults.on_step, on_change=faults.on_change, on_nodes=faults.on_nodes,
                     env={"OMP_NUM_THREADS": "1", **(env or {})})
    assert [(e.kind, e.world_size) for e in metrics.events] == [("lost", 4), ("replanned", 2), ("resumed", 2)], \
        metrics.events
    assert [s.step for s in metrics.steps] == list(range(cfg.steps)) and metrics.summary.world_size == 2
    return metrics


def test_node_cut_off_is_detected_by_the_timeout_and_the_run_shrinks(cluster, tmp_path):
    """Node 1's link goes down: nothing closes, so node 0's collectives time out (10 s here), and the run
    goes on without it, from the newest complete checkpoint."""
    cfg, where = _elastic_config(tmp_path / "ckpt", steps=SHRINK_STEPS, timeout_s=10.0)
    metrics = _run_with_fault(cfg, where, lambda nodes, node: nodes.cut_off(node), at_step=7)
    lost, _, resumed = metrics.events
    assert "timed out" in lost.detail.lower() or "timeout" in lost.detail.lower(), lost
    done = resumed.step + resumed.steps_lost
    assert done > 7 and resumed.step == done // 5 * 5
    _no_leftovers(cluster, tmp_path / "ckpt")


def test_node_killed_in_the_middle_of_a_checkpoint_write_resumes_from_the_one_before(cluster, tmp_path):
    """Every rank has written its part of checkpoint 10 (the test hook holds them there for 4 s) when
    node 1 dies: the write never completes, so the run resumes from checkpoint 5 and the half-written
    folder is removed."""
    from runners.checkpoint import PAUSE_ENV

    ckpt = tmp_path / "ckpt"
    cfg, where = _elastic_config(ckpt, steps=SHRINK_STEPS)
    partial = ckpt / "step-00000010.tmp"

    def kill_mid_write(nodes, node):
        def watch():
            import time

            deadline = time.monotonic() + 60
            while len(list(partial.glob("*.distcp"))) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            nodes.kill(node)

        threading.Thread(target=watch, daemon=True).start()

    metrics = _run_with_fault(cfg, where, kill_mid_write, at_step=6, env={PAUSE_ENV: "10:4"})
    resumed = metrics.events[-1]
    # Steps 5..8 were reported; the 10th step was trained but is reported only after its checkpoint.
    assert resumed.step == 5 and resumed.steps_lost == 4, metrics.events
    _no_leftovers(cluster, ckpt)
