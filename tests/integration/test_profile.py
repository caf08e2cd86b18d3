"""`planner profile` end to end on loopback (2 gloo processes), its JSON through resolve_hardware, and bad input."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from specs.errors import PlannerError
from profilers.fit import bus_factor
from profilers.profile import PROFILER_VERSION
from runners.probe import SYNC_SEGMENTS_S
from specs.hardware import Hardware, resolve_hardware

runner = CliRunner()
# The largest message dominates its time by far, so a loaded machine cannot make the curve fall.
SIZES = "4k,256k,16m"


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    start = time.perf_counter()
    # A short layer probe: these tests check what the profile holds, not how precisely it was timed.
    result = runner.invoke(app, ["profile", "--quick", "--nproc", "2", "--sizes", SIZES, "--probe-seconds", "0.3",
                                 "--collectives", "all_reduce,all_gather,p2p,ring_step", "--out", str(out), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - start < 120
    return out


def test_profile_json_round_trips_through_resolve_hardware(profile_path: Path) -> None:
    hw = resolve_hardware(str(profile_path))
    assert hw.source == "profile" and hw.device_type == "cpu" and hw.profiler_version == PROFILER_VERSION
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    assert hw.gemm_points and {p.dtype for p in hw.gemm_points} >= {"fp32"}
    assert set(hw.elementwise_bytes_per_s) >= {"layer_norm", "rms_norm", "gelu", "silu"}
    assert 0 < hw.gemm_max_efficiency <= 1 and hw.kernel_overhead_s > 0
    # The fused attention kernel by sequence at the tiny model's head width (8) and 64, forward and backward,
    # timed on both ranks at once beside the ring's steps.
    assert {(p.head_dim, p.seq_len, p.concurrent) for p in hw.attention_points if p.dtype == "fp32"} == \
        {(d, s, True) for d in (8, 64) for s in (64, 256, 1024, 2048)}
    assert all(0 < p.forward_s and 0 < p.backward_s for p in hw.attention_points)
    # The engine's ring steps by local tokens, at the tiny model's head width and GQA ratio (8 heads, 4 K/V),
    # timed on both ranks at once.
    assert [(p.side, p.num_heads, p.num_kv_heads, p.head_dim, p.concurrent) for p in hw.ring_points] == \
        [(s, 4, 2, 8, True) for s in (16, 64, 256, 1024)]
    assert all(0 < v for p in hw.ring_points for v in (p.square_forward_s, p.square_backward_s, p.half_forward_s,
                                                        p.half_backward_s))
    # The layer probe ran on both ranks at once and, on CPU, its fit is the profile's calibration; the tiny
    # model gets the compute-bound point (2048 tokens at its longest sequence, 128).
    assert [(p.micro_batch, p.seq_len, p.recompute) for p in hw.layer_probe] == \
        [(1, 8, "none"), (1, 64, "none"), (4, 64, "none"), (16, 128, "none"), (1, 64, "full"), (1, 64, "selective")]
    assert all(0 < p.forward_s < p.forward_backward_s for p in hw.layer_probe)
    assert hw.calibration["recompute_overhead_s"] >= 0
    assert hw.calibration["selective_recompute_overhead_s"] >= 0
    assert set(hw.overlap_probe) == {"compute_s", "forward_s", "comm_s", "serial_s", "both_s", "efficiency"}
    probe = hw.overlap_probe
    assert 0 < probe["forward_s"] <= probe["compute_s"] < probe["serial_s"] and -1 <= probe["efficiency"] <= 1
    assert hw.calibration["compute_time_scale"] > 0 and hw.calibration["op_overhead_s"] >= 0
    assert hw.calibration["comm_overlap_efficiency"] == hw.overlap_probe["efficiency"]
    # The context-parallel probe: both kinds over the CP group of both ranks, kept as seconds per message
    # beyond their price.
    kinds = {f"{kind}2_{what}_s" for kind in ("ring", "a2a") for what in ("local", "comm")}
    assert set(hw.context_probe) == {"world", "seq_len"} | kinds
    assert {k for k in hw.calibration if k.startswith("engine_")} == {"engine_ring_extra_s_2", "engine_a2a_extra_s_2"}
    # The sync-wait probe: the group of both ranks after each segment, kept as calibration keys.
    segments = {round(w * 1e6) for w in SYNC_SEGMENTS_S}
    assert set(hw.sync_probe) == {"world"} | {f"sync2_{w}_s" for w in segments}
    assert {k: v for k, v in hw.calibration.items() if k.startswith("sync_wait_s_")} == \
        {f"sync_wait_s_2_{w}": hw.sync_probe[f"sync2_{w}_s"] for w in segments}


def test_profile_fits_describe_the_raw_curves(profile_path: Path) -> None:
    hw = resolve_hardware(str(profile_path))
    measured = {(f.collective, f.link, f.group_size) for f in hw.collectives}
    # One node of two processes: every group is inside the node.
    assert measured == {("all_reduce", "intra_node", 2), ("all_gather", "intra_node", 2), ("p2p", "intra_node", 2),
                        ("ring_step", "intra_node", 2)}
    for fit in hw.collectives:
        assert len(fit.sizes_bytes) == 3 and len(fit.median_s) == 3 and len(fit.spread_s) == 3
        assert all(s >= 0 for s in fit.spread_s)
        # The fit reproduces the largest message's time (bandwidth-dominated) to within 2x on a busy box.
        big_bytes, big_s = fit.sizes_bytes[-1], fit.median_s[-1]
        predicted = fit.latency_s + big_bytes * bus_factor(fit.collective, fit.group_size) / fit.bandwidth_bytes_per_s
        assert 0.5 < predicted / big_s < 2.0
    p2p = next(f for f in hw.collectives if f.collective == "p2p")
    assert hw.intra_node.bandwidth_bytes_per_s == p2p.bandwidth_bytes_per_s
    # The inter-node link was not measured on one node, so it keeps the cpu preset's figure.
    assert hw.inter_node == resolve_hardware("cpu").inter_node


def test_estimate_prices_a_plan_on_the_measured_profile(profile_path: Path) -> None:
    args = ["estimate", "--model", "tiny", "--gpus", "2", "--global-batch", "8", "--seq-len", "128", "--format", "json"]
    measured = runner.invoke(app, [*args, "--hardware", str(profile_path)])
    preset = runner.invoke(app, [*args, "--hardware", "cpu"])
    assert measured.exit_code == 0 and preset.exit_code == 0, measured.output + preset.output
    step_s = json.loads(measured.output)["step_time_s"]
    assert step_s > 0 and step_s != json.loads(preset.output)["step_time_s"]
    # Capacity is the host memory shared by the two processes: the limit follows the profile.
    limit = json.loads(measured.output)["memory_limit_bytes"]
    assert limit <= resolve_hardware(str(profile_path)).memory_bytes


def test_corrupt_profile_names_the_field(profile_path: Path, tmp_path: Path) -> None:
    data = json.loads(profile_path.read_text())
    del data["inter_node"]
    bad = tmp_path / "missing.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlannerError, match="missing key 'inter_node'"):
        resolve_hardware(str(bad))
    data = json.loads(profile_path.read_text())
    data["collectives"][0]["bandwidth_bytes_per_s"] = "fast"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlannerError, match=r"collectives\[0\]\.bandwidth_bytes_per_s"):
        resolve_hardware(str(bad))
    bad.write_text(profile_path.read_text()[:200])
    with pytest.raises(PlannerError, match="not valid JSON"):
        resolve_hardware(str(bad))


def test_profile_on_another_device_kind_is_named(profile_path: Path) -> None:
    hw = resolve_hardware(str(profile_path))
    message = hw.mismatch(device_type="cuda")
    assert message and "measured on cpu" in message
    assert hw.mismatch(device_type="cpu", device_name=hw.device_name) is None
    assert "re-run `planner profile`" in hw.mismatch(device_type="cpu", device_name="another cpu")
    assert resolve_hardware("h100").mismatch(device_type="cpu") is None


def _comm_workers() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"profilers.comm" in cmdline:
            pids.append(int(entry))
    return pids


def test_failed_rank_is_named_and_nothing_is_left_running(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PLANNER_PROFILE_FAIL_RANK", "1")
    before = set(_comm_workers())
    result = runner.invoke(app, ["profile", "--quick", "--nproc", "2", "--sizes", "4k,64k",
                                 "--collectives", "all_reduce", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 1
    assert "rank 1" in result.output and "injected failure" in result.output
    assert not (tmp_path / "p.json").exists()
    time.sleep(0.5)
    assert set(_comm_workers()) - before == set()


@pytest.mark.parametrize("args,message", [
    (["--sizes", "1x,2k"], "bad message size '1x'"),
    (["--sizes", "4k"], "at least two positive message sizes"),
    (["--nproc", "0"], "--nproc must be at least 1"),  # one process profiles a GPU (no collectives)
    (["--collectives", "all_reduce,gossip"], "unknown collective 'gossip'"),
    (["--nproc", "3", "--gpus-per-node", "2"], "not a multiple of --gpus-per-node"),
])
def test_bad_profile_options_are_one_line_errors(args: list[str], message: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["profile", *args, "--out", str(tmp_path / "p.json")])
    # CliRunner sees the raw exception; main() turns it into one line and exit code 2.
    assert isinstance(result.exception, PlannerError) and message in str(result.exception)


def test_ctrl_c_leaves_no_worker_behind(tmp_path: Path) -> None:
    import signal
    import subprocess

    before = set(_comm_workers())
    # Ctrl-C as a terminal delivers it: with SIGINT's default action in the child. A test run started in the
    # background of a non-interactive shell inherits SIGINT ignored, and Python then keeps ignoring it.
    proc = subprocess.Popen(["planner", "profile", "--quick", "--nproc", "2", "--sizes", "1m,16m,64m",
                             "--collectives", "all_reduce", "--out", str(tmp_path / "p.json"), "--format", "json"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 90
    while not set(_comm_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(_comm_workers()) - before, "the collective workers never started"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) != 0
    time.sleep(0.5)
    assert set(_comm_workers()) - before == set()
    assert not (tmp_path / "p.json").exists()
