"""Whether this host can run the emulated-cluster tests (root, iproute2, network namespaces)."""

from __future__ import annotations

import os
import shutil
import subprocess


def netns_skip_reason(prefix: str) -> str | None:
    """None where a network namespace named `<prefix>-probe` can be made (and removed), else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc): apt-get install -y iproute2"
    probe = subprocess.run(["ip", "netns", "add", f"{prefix}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{prefix}-probe"], capture_output=True)
    return None
