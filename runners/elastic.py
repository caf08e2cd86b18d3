"""Elastic runs: torchrun's c10d rendezvous over a range of nodes, and the record of every change.

    planner run --cluster --elastic 1:2 --checkpoint-dir ckpt --checkpoint-every 2 --max-restarts 3

How a change happens (torchrun does the membership, this project the rest):
- A node is lost: the survivors' next collective fails (a killed node closes its sockets) or times out
  (a node cut off closes nothing: the collective timeout, runners/faults.py). Their agent stops its
  workers and joins the next rendezvous round; the lost node's keep-alive expires (KEEP_ALIVE_* below),
  the round closes with the nodes that are left (at least MIN), and the agent starts workers with the
  new WORLD_SIZE.
- A node comes back: its agent waits at the rendezvous; the running agents see it waiting (every
  MONITOR_INTERVAL_S) and restart their workers into a round with it (torchrun counts this as no
  failure). The workers resume from the newest complete checkpoint: "scale up at the next checkpoint"
  is approximated by scaling up at once and training again the steps since the last checkpoint.
- Every (re)start: each worker picks the plan for its WORLD_SIZE from the table the application handed
  in (RunConfig.elastic_plans, planner/elastic.py) and resumes from the newest complete checkpoint, which
  is plan-independent (runners/checkpoint.py), so a resume under another plan is the ordinary resume.

Store: every attempt gets a fresh c10d store hosted by its rank 0 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE):
the agent's shared store would carry keys across attempts, and the restart count that could namespace
them is per agent (a node that joins later counts from 0), so the ranks of one attempt would disagree.

The rendezvous is hosted by the agent on the --rdzv-endpoint host (node 0 on the emulated cluster): that
node must survive (torchrun's c10d backend; an etcd backend would lift this).

`ElasticLog` (launcher side) turns the workers' events into the run's ElasticEvents and keeps every
step's final record across attempts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runners.config import ElasticEvent, StepRecord

# Rendezvous settings (torchrun --rdzv-conf). torchrun's defaults suit long jobs on big clusters and
# would spend most of a minute per change: a lost node's keep-alive expires after interval x attempts
# (default 5 s x 3), and a round that has its minimum waits last_call (default 30 s) for more nodes.
KEEP_ALIVE_INTERVAL_S = 1
KEEP_ALIVE_MAX_ATTEMPTS = 3
LAST_CALL_S = 1
JOIN_TIMEOUT_S = 300
# How often an agent checks its workers and the rendezvous's waiting nodes (torchrun's default 0.1 s
# polls the store ten times a second on every node; half a second is quick next to a restart).
MONITOR_INTERVAL_S = 0.5
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def parse_node_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' (or 'N') nodes to (min, max); ValueError naming the bad text."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low, high = 0, 0
    if not 1 <= low <= high:
        raise ValueError(f"--elastic takes MIN:MAX nodes with 1 <= MIN <= MAX (e.g. 1:2), got {text!r}")
    return low, high


def torchrun_elastic_args(*, nodes: tuple[int, int], endpoint: str, run_id: str, max_restarts: int,
                          is_host: bool | None = None, local_addr: str | None = None) -> list[str]:
    """torchrun's options for one node of an elastic run (the worker module and --nproc-per-node follow).
    `is_host`: whether this node hosts the rendezvous (None: torchrun matches the endpoint to this host's
    names); `local_addr`: the address the other nodes reach this one at (None: its host name)."""
    conf = (f"last_call_timeout={LAST_CALL_S},join_timeout={JOIN_TIMEOUT_S},"
            f"keep_alive_interval={KEEP_ALIVE_INTERVAL_S},keep_alive_max_attempt={KEEP_ALIVE_MAX_ATTEMPTS}")
    if is_host is not None:
        conf += f",is_host={int(is_host)}"
    args = [f"--nnodes={nodes[0]}:{nodes[1]}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf={conf}", f"--max-restarts={max_restarts}",
            f"--monitor-interval={MONITOR_INTERVAL_S}"]
    return args + ([f"--local-addr={local_addr}"] if local_addr else [])


# --- the launcher's record ----------------------------------------------------------------------------------
@dataclass
class ElasticLog:
    """The changes of an elastic run, from the worker events the launcher reads (runners.launch):
    `plan` (rank 0, at every start: world size and plan), `resumed` (rank 0, before the first step of
    a start), `step`, and `failed` (any rank whose collective broke), plus `node_lost` from the cluster
    launcher when a node's agent exits. Times are seconds since the log was made."""

    start_wall_s: float = field(default_factory=time.time)
    events: list[ElasticEvent] = field(default_factory=list)
    steps: dict[int, StepRecord] = field(default_factory=dict)
    world_size: int = 0
    steps_done: int = 0  # steps completed before the current failure (the highest reported + 1)
    lost_since_start: bool = False

    def _add(self, kind: str, *, wall_s: float | None, step: int, steps_lost: int = 0, detail: str = "") -> ElasticEvent:
        event = ElasticEvent(kind=kind, time_s=round((wall_s or time.time()) - self.start_wall_s, 3),
                             world_size=self.world_size, step=step, steps_lost=steps_lost, detail=detail)
        self.events.append(event)
        return event

    def on_event(self, event: dict) -> list[ElasticEvent]:
        """Take one worker event; returns the ElasticEvents it made (to print)."""
        kind, wall_s = event.get("kind"), event.get("time")
        if kind == "step":
            # A replayed step (from the checkpoint a start resumed from) is the record of the attempt the
            # run continues from; it may be one that attempt was stopped before reporting.
            self.steps[event["step"]] = StepRecord(step=event["step"], loss=event["loss"],
                                                   step_time_s=event["step_time_s"])
            if not event.get("replayed"):
                self.steps_done = max(self.steps_done, event["step"] + 1)
            return []
        if kind == "failed":
            return self.lost(str(event.get("message", "")), wall_s=wall_s)
        if kind == "plan":
            return self._started(event, wall_s=wall_s)
        if kind == "resumed" and self.events:
            lost = max(0, self.steps_done - event["step"])
            self.steps_done = event["step"]
            return [self._add("resumed", wall_s=wall_s, step=event["step"], steps_lost=lost,
                              detail=f"from checkpoint step {event['step']}" if event["step"] else "from step 0")]
        return []

    def lost(self, detail: str, *, wall_s: float | None = None) -> list[ElasticEvent]:
        """A failure seen (a worker's broken collective, or a node's agent that exited): once per start."""
        if self.lost_since_start or not self.world_size:
            return []
        self.lost_since_start = True
        return [self._add("lost", wall_s=wall_s, step=self.steps_done, detail=detail)]

    def _started(self, event: dict, *, wall_s: float | None) -> list[ElasticEvent]:
        world, previous = event["world_size"], self.world_size
        made: list[ElasticEvent] = []
        self.world_size = world
        if previous:
            if world > previous:
                made.append(self._add("scaled_up", wall_s=wall_s, step=self.steps_done,
                                      detail=f"{previous} -> {world} processes"))
            elif not self.lost_since_start:  # a restart without a failure event: the loss was silent
                made.append(self._add("lost", wall_s=wall_s, step=self.steps_done, detail="restarted by torchrun"))
            made.append(self._add("replanned", wall_s=wall_s, step=self.steps_done,
                                  detail=f"{world} processes: {event.get('plan', '')}"))
        self.lost_since_start = False
        return made

    def merged_steps(self) -> tuple[StepRecord, ...]:
        """Every step's record from the attempt that trained it last."""
        return tuple(self.steps[k] for k in sorted(self.steps))
