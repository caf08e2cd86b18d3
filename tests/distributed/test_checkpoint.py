"""Checkpoints are plan-independent and exact: save under one plan, resume under another, and the losses
and parameters continue as the uninterrupted one-process run's (fp32, 1e-4 / 1e-3).

Plans of one world size share one set of gloo processes (runners after one another, as in
test_exactness): each case trains plan A for K steps with checkpoints, then plan B resumes from them up
to N steps. Two cases save on 4 processes and resume on 2 (the cluster shrank); four are MoE models whose
experts change their EP and expert-TP split and expert-DP sharding across the resume.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specs.errors import PlannerError
from specs.plan import Plan
from runners import checkpoint as ck
from runners.reference import train_reference
from tests.distributed.harness import LOSS_TOL, PARAM_ABS_TOL, run_plans, tiny_config

SAVE_STEPS, TOTAL_STEPS = 3, 6


def _z(dp: int, stage: int, **kw) -> Plan:
    degrees = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[stage]
    return Plan(dp=dp, param_shard=degrees[0], grad_shard=degrees[1], optim_shard=degrees[2], **kw)


# name: (saving plan, resuming plan); global batch 8 everywhere.
CASES = {
    "zero3-dp2->tp2": (_z(2, 3, micro_batch=2, num_micro_batches=2), Plan(tp=2, micro_batch=2, num_micro_batches=4)),
    "dp2->pp2": (_z(2, 0, micro_batch=1, num_micro_batches=4), Plan(pp=2, micro_batch=1, num_micro_batches=8)),
    "tp2-sp->zero2-dp2": (Plan(tp=2, sequence_parallel=True, micro_batch=4, num_micro_batches=2),
                          _z(2, 2, micro_batch=1, num_micro_batches=4)),
    "tied-pp2->zero2-dp2": (Plan(pp=2, micro_batch=1, num_micro_batches=8), _z(2, 2, micro_batch=2, num_micro_batches=2)),
    "zero3-dp4->tp2xdp2": (_z(4, 3, micro_batch=1, num_micro_batches=2),
                           Plan(dp=2, tp=2, optim_shard=2, micro_batch=2, num_micro_batches=2)),
    "zero1-dp4->pp2xdp2": (_z(4, 1, micro_batch=2, num_micro_batches=1),
                           Plan(dp=2, pp=2, grad_shard=2, optim_shard=2, micro_batch=1, num_micro_batches=4)),
    "mixed-2-2-4-dp4->zero1-dp2 (4 procs -> 2)": (Plan(dp=4, param_shard=2, grad_shard=2, optim_shard=4, micro_batch=1,
                                                       num_micro_batches=2),
                                                  _z(2, 1, micro_batch=4, num_micro_batches=1)),
    # MoE (tiny-moe): the experts' weights and moments as [experts x rows, cols] tensors split over EP, from
    # their own engine over expert-DP; resumed with the experts replicated and ZeRO-3 over expert-DP, and
    # from ep4 over dp4 to ep2 over tp2 + SP x dp2.
    "moe-ep2-zero1->ep1-zero3": (Plan(dp=2, ep=2, optim_shard=2, micro_batch=2, num_micro_batches=2),
                                 _z(2, 3, micro_batch=2, num_micro_batches=2)),
    "moe-ep4-dp4->ep2-tp2-sp-dp2": (Plan(dp=4, ep=4, micro_batch=1, num_micro_batches=2),
                                    Plan(dp=2, tp=2, ep=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2)),
    # Expert TP: each ETP rank writes its slice of every expert's rows (w_gate, w_in) or columns (w_out),
    # read back whole-width under EP or by the other slice count.
    "moe-etp2-zero2-dp2->ep2": (_z(2, 2, etp=2, micro_batch=2, num_micro_batches=2),
                                Plan(dp=2, ep=2, micro_batch=2, num_micro_batches=2)),
    "moe-ep2-etp2-dp4->etp2-zero3 (4 procs -> 2)": (Plan(dp=4, ep=2, etp=2, optim_shard=4, micro_batch=1,
                                                         num_micro_batches=2),
                                                    _z(2, 3, etp=2, micro_batch=2, num_micro_batches=2)),
}
MODEL_CHANGES = {"tied-pp2->zero2-dp2": {"tied_embeddings": True}}
MODELS = {name: "tiny-moe" for name in CASES if name.startswith("moe-")}
# Tied embeddings: two copies with summed gradients drift from the one-process shared parameter by up to
# ~1e-3 by step 6 with or without checkpoints (Adam magnifies the order of summing near-zero gradients
# of rare tokens), so these cases compare with the saving plan's own uninterrupted run.
AGAINST_UNINTERRUPTED = {"tied-pp2->zero2-dp2"}
_results: dict[str, tuple[dict, dict, dict, dict]] = {}
_uninterrupted: dict[str, tuple[dict, dict]] = {}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def _configs(name: str, root: Path):
    plan_a, plan_b = CASES[name]
    folder = str(root / name.split(" ")[0].replace(">", ""))
    changes = dict(MODEL_CHANGES.get(name, {}), model=MODELS.get(name, "tiny"))
    save = dataclasses.replace(tiny_config(plan_a, steps=SAVE_STEPS, **changes), checkpoint_dir=folder,
                               checkpoint_every=2)
    resume = dataclasses.replace(tiny_config(plan_b, steps=TOTAL_STEPS, **changes), checkpoint_dir=folder,
                                 checkpoint_every=2, resume=True)
    return save, resume


def _run_all(root: Path) -> None:
    """Savers first (4-process ones before the 2-process group that resumes one of them), then resumers."""
    pairs = {name: _configs(name, root) for name in CASES}
    by_world: dict[int, list] = {}
    for name, (save, resume) in pairs.items():
        by_world.setdefault(save.plan.world_size, []).append(("save", name, save))
    for name, (save, resume) in pairs.items():
        by_world.setdefault(resume.plan.world_size, []).append(("resume", name, resume))
        if name in AGAINST_UNINTERRUPTED:
            whole = dataclasses.replace(save, steps=TOTAL_STEPS, checkpoint_dir=None, checkpoint_every=0)
            by_world.setdefault(save.plan.world_size, []).append(("whole", name, whole))
    results: dict[tuple[str, str], tuple] = {}
    for world in sorted(by_world, reverse=True):
        entries = by_world[world]
        for (kind, name, _), result in zip(entries, run_plans([cfg for _, _, cfg in entries])):
            results[(kind, name)] = result
    for name in CASES:
        _results[name] = (*results[("save", name)], *results[("resume", name)])
        if name in AGAINST_UNINTERRUPTED:
            _uninterrupted[name] = results[("whole", name)]


@pytest.mark.parametrize("name", list(CASES))
def test_resume_under_another_plan_continues_exactly(name, ckpt_root):
    if not _results:
        _run_all(ckpt_root)
    save_cfg, resume_cfg = _configs(name, ckpt_root)
    save_metrics, _, resume_metrics, params = _results[name]
    if name in AGAINST_UNINTERRUPTED:
        whole_metrics, ref_params = _uninterrupted[name]
        ref_losses = whole_metrics.losses
    else:
        ref_losses, ref_params = train_reference(dataclasses.replace(resume_cfg, checkpoint_dir=None, resume=False))
    assert [s.step for s in save_metrics.steps] == list(range(SAVE_STEPS))
    assert [s.step for s in resume_metrics.steps] == list(range(SAVE_STEPS, TOTAL_STEPS))
    losses = save_metrics.losses + resume_metrics.losses
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= LOSS_TOL, f"{name}: loss differs by {worst:.2e}\n ours {losses}\n ref  {ref_losses}"
    assert set(params) == set(ref_params)
    for key, ref in ref_params.items():
        diff = (params[key] - ref).abs().max().item()
        assert diff <= PARAM_ABS_TOL, f"{name}: parameter {key} differs by {diff:.2e}"
    folder = Path(resume_cfg.checkpoint_dir)
    # Saved at step 2 (every 2) and 3 (the saver's end), then 4 and 6 by the resumer; the newest 2 are kept.
    assert sorted(p.name for p in folder.iterdir()) == ["latest", ck.step_dir_name(4), ck.step_dir_name(6)]
    assert ck.find_latest(folder) == folder / ck.step_dir_name(6)
    meta = ck.load_meta(folder / ck.step_dir_name(6))
    assert meta.step == 6 and meta.plan == resume_cfg.plan and meta.world_size == resume_cfg.plan.world_size
    # It keeps the records of the steps it trained since checkpoint 4, for a resume to replay.
    assert [(r.step, r.loss) for r in meta.records] == [(s.step, s.loss) for s in resume_metrics.steps[-2:]]


def test_checkpoint_holds_each_canonical_tensor_once(ckpt_root):
    """The DCP metadata lists every parameter with its full one-process shape, for weights and both moments."""
    if not _results:
        _run_all(ckpt_root)
    save_cfg, resume_cfg = _configs("zero3-dp4->tp2xdp2", ckpt_root)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(Path(resume_cfg.checkpoint_dir) / ck.step_dir_name(6)).read_metadata()
    _, ref_params = train_reference(dataclasses.replace(save_cfg, steps=1, checkpoint_dir=None))
    expected = {f"{prefix}/{name}": tuple(t.shape) for name, t in ref_params.items()
                for prefix in ("model", "optim/exp_avg", "optim/exp_avg_sq")}
    got = {key: tuple(md.size) for key, md in metadata.state_dict_metadata.items()}
    assert got == expected


# --- atomicity: incomplete checkpoints are never picked ------------------------------------------------------
def _fake_complete(folder: Path, step: int) -> Path:
    path = folder / ck.step_dir_name(step)
    path.mkdir(parents=True)
    (path / ck.DCP_METADATA_FILE).write_bytes(b"x")
    (path / ck.META_FILE).write_text("{}")
    return path


def test_find_latest_skips_incomplete_and_dangling(tmp_path):
    assert ck.find_latest(tmp_path / "absent") is None
    good = _fake_complete(tmp_path, 4)
    _fake_complete(tmp_path, 2)
    (tmp_path / (ck.step_dir_name(6) + ".tmp")).mkdir()          # killed mid-write
    partial = tmp_path / ck.step_dir_name(8)
    partial.mkdir()
    (partial / ck.DCP_METADATA_FILE).write_bytes(b"x")             # renamed without its metadata: not complete
    assert ck.find_latest(tmp_path) == good
    (tmp_path / ck.LATEST_FILE).write_text(ck.step_dir_name(2) + "\n")
    assert ck.find_latest(tmp_path) == tmp_path / ck.step_dir_name(2)   # the pointer wins when complete
    (tmp_path / ck.LATEST_FILE).write_text(ck.step_dir_name(9) + "\n")
    assert ck.find_latest(tmp_path) == good                             # dangling pointer: newest complete
    (tmp_path / ck.LATEST_FILE).write_text("../../etc\n")
    assert ck.find_latest(tmp_path) == good


def test_find_latest_rejects_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(PlannerError, match="not a directory"):
        ck.find_latest(path)


def test_resume_checks_the_run_is_the_same(tmp_path):
    cfg = tiny_config(_z(2, 0, micro_batch=1, num_micro_batches=4), steps=5)
    meta = ck.CheckpointMeta(step=3, seed=cfg.seed, model=cfg.model, job=cfg.job, data=None, plan=cfg.plan,
                             world_size=2, rng_states=("", ""))
    meta.check_compatible(cfg)
    with pytest.raises(PlannerError, match="seed"):
        meta.check_compatible(dataclasses.replace(cfg, seed=cfg.seed + 1))
    with pytest.raises(PlannerError, match="model"):
        meta.check_compatible(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=128)))
    with pytest.raises(PlannerError, match="nothing left to train"):
        meta.check_compatible(dataclasses.replace(cfg, steps=3))
    assert ck.CheckpointMeta.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta


# --- the box decomposition ---------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 7), cols=st.integers(1, 7), data=st.data())
def test_flat_range_boxes_cover_the_range_once(rows, cols, data):
    start = data.draw(st.integers(0, rows * cols))
    stop = data.draw(st.integers(start, rows * cols))
    full = torch.arange(rows * cols).view(rows, cols)
    seen = []
    boxes = ck.flat_range_boxes((rows, cols), start, stop)
    assert len(boxes) <= 3
    for (r, c), (h, w), flat in boxes:
        block = full[r:r + h, c:c + w]
        assert block.shape == (h, w)
        assert block.reshape(-1).tolist() == list(range(flat, flat + h * w))  # a contiguous run
        seen += block.reshape(-1).tolist()
    assert sorted(seen) == list(range(start, stop))


@settings(max_examples=200, deadline=None)
@given(etp_dim=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]), etp=st.sampled_from([1, 2, 3]),
       data=st.data())
def test_expert_boxes_place_every_slice_of_every_rank_once(etp_dim, ep, etp, data):
    # An expert weight [4, 6, 6] (w_gate-like: expert TP cuts dim 1; w_out-like: dim 2) stored as [24, 6]:
    # every (EP rank, ETP rank)'s local slice, any flat range of it, lands on the global values it holds.
    from types import SimpleNamespace

    full = torch.arange(4 * 6 * 6).view(4, 6, 6)
    stored = full.view(24, 6)
    cover = torch.zeros(24, 6, dtype=torch.int64)
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            local = full[ep_rank * 4 // ep:(ep_rank + 1) * 4 // ep]
            local = local.narrow(etp_dim, etp_rank * 6 // etp, 6 // etp)
            values = local.reshape(-1)
            whole = data.draw(st.booleans())
            lo = 0 if whole else data.draw(st.integers(0, values.numel()))
            hi = values.numel() if whole else data.draw(st.integers(lo, values.numel()))
            shape, boxes = ck._expert_boxes(SimpleNamespace(shape=tuple(local.shape), etp_split_dim=etp_dim), lo, hi,
                                            ep_rank=ep_rank, ep=ep, etp_rank=etp_rank, etp=etp)
            assert shape == (24, 6)
            assert sum(h * w for _, (h, w), _ in boxes) == hi - lo
            for (r, c), (h, w), flat in boxes:
                assert torch.equal(values[flat:flat + h * w].view(h, w), stored[r:r + h, c:c + w])
                cover[r:r + h, c:c + w] += whole
    assert cover.max() <= 1  # no two ranks write one element


def test_checkpoint_folder_names_sort_by_step(tmp_path):
    for step in (9, 10, 100):
        _fake_complete(tmp_path, step)
    assert ck.find_latest(tmp_path).name == ck.step_dir_name(100)
    shutil.rmtree(tmp_path / ck.step_dir_name(100))
    assert ck.find_latest(tmp_path).name == ck.step_dir_name(10)


def _killed_mid_write_worker(root: str, port: int, queue) -> None:
    """One gloo process: checkpoint 2 completes; the write of checkpoint 4 dies after its data files are
    written and before its rename (an exception where a kill would land); then the run resumes. Puts the
    losses of the resumed and of an uninterrupted run, and what the folder held after the failure."""
    import os
    import traceback

    import torch.distributed as dist

    from runners.train import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    try:
        dist.init_process_group("gloo", rank=0, world_size=1)
        cfg = tiny_config(Plan(micro_batch=4, num_micro_batches=2), steps=2).replace(checkpoint_dir=root, checkpoint_every=2)
        train(cfg, device=torch.device("cpu"))
        original = ck.write_json_atomic

        def killed(path, data):
            if ck.step_dir_name(4) + ".tmp" in str(path):
                raise RuntimeError("killed between the temp write and the rename")
            original(path, data)

        ck.write_json_atomic = killed
        try:
            train(cfg.replace(steps=4, resume=True), device=torch.device("cpu"))
            raise AssertionError("the injected failure did not happen")
        except RuntimeError as exc:
            assert "killed between" in str(exc)
        finally:
            ck.write_json_atomic = original
        after = {"latest": ck.find_latest(root).name, "tmp_files": sorted(p.name for p in Path(root, ck.step_dir_name(4) + ".tmp").iterdir()),
                 "complete": sorted(p.name for p in Path(root).iterdir())}
        resumed, _ = train(cfg.replace(steps=6, resume=True), device=torch.device("cpu"))
        whole, _ = train(cfg.replace(steps=6, checkpoint_dir=root + "-whole"), device=torch.device("cpu"))
        queue.put(("ok", after, (resumed.losses, [s.step for s in resumed.steps], whole.losses)))
        dist.destroy_process_group()
    except BaseException:
        queue.put(("error", traceback.format_exc(), None))


def test_a_write_killed_before_its_rename_leaves_the_previous_checkpoint_newest(tmp_path):
    """Atomic writes: data goes into step-N.tmp (files fsynced), and only a finished write is renamed to
    step-N and named by `latest`. A write that dies in between leaves the previous complete checkpoint as
    the newest; the resume removes the half-written folder and continues exactly."""
    from tests.distributed.harness import free_port
    from tests.distributed.spawn import context

    root = str(tmp_path / "ckpt")
    ctx = context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_killed_mid_write_worker, args=(root, free_port(), queue))
    proc.start()
    try:
        status, after, losses = queue.get(timeout=300)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", after
    assert after["latest"] == ck.step_dir_name(2)
    assert any(name.endswith(".distcp") for name in after["tmp_files"]) and ck.DCP_METADATA_FILE in after["tmp_files"]
    assert ck.META_FILE not in after["tmp_files"]
    resumed, steps, whole = losses
    assert steps == [2, 3, 4, 5] and resumed == whole[2:]
    assert sorted(p.name for p in Path(root).iterdir()) == [ck.LATEST_FILE, ck.step_dir_name(4), ck.step_dir_name(6)]
