"""Every tensor handed to a collective lives on the run's device (issue 11, bug 1).

An NCCL process group has no backend for CPU tensors ("No backend type associated with device type
cpu"): a statistic built with torch.tensor(...) and no device, then all-reduced, stops every CUDA run
at its first step while gloo on CPU takes it happily. CPU-only CI cannot run NCCL, so this reads the
source: in runners/ and profilers/, a tensor made by a torch factory without `device=` (torch.tensor,
zeros, ones, empty, full, arange, rand, randn) must never reach a collective, whether directly or through
a name in the same function. (tests/distributed/test_precision.py also checks, at run time, that every
tensor a run hands to torch.distributed is on the run's device, contiguous and of a dtype NCCL reduces.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "as_tensor"}
COLLECTIVES = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "isend", "irecv", "send", "recv",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
               "all_to_all_single", "reduce", "scatter", "gather"}


def _is_device_less_factory(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES):
        return False
    owner = node.func.value
    return isinstance(owner, ast.Name) and owner.id == "torch" and not any(k.arg == "device" for k in node.keywords)


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def violations(source: str, filename: str) -> list[str]:
    """'file:line name' for each collective argument that is (or names) a device-less factory tensor."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        device_less = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _is_device_less_factory(node.value):
                device_less |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and _called_name(node) in COLLECTIVES):
                continue
            for arg in list(node.args) + [k.value for k in node.keywords]:
                if _is_device_less_factory(arg) or (isinstance(arg, ast.Name) and arg.id in device_less):
                    found.append(f"{filename}:{node.lineno} {_called_name(node)}")
    return found


def test_no_device_less_tensor_reaches_a_collective():
    found = []
    for room in ("runners", "profilers"):
        for path in sorted((ROOT / room).rglob("*.py")):
            found += violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "tensors without device= handed to collectives (NCCL has no CPU backend):\n" + "\n".join(found)


def test_the_check_sees_the_bug_it_guards_against():
    bug = ("def summary(elapsed, device):\n"
           "    seconds = torch.tensor([elapsed], dtype=torch.float64)\n"
           "    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)\n"
           "    self.comm.all_reduce(torch.zeros(3), group)\n")
    fixed = bug.replace("dtype=torch.float64)", "dtype=torch.float64, device=device)").replace(
        "torch.zeros(3)", "torch.zeros(3, device=device)")
    assert violations(bug, "x.py") == ["x.py:3 all_reduce", "x.py:4 all_reduce"]
    assert violations(fixed, "x.py") == []
