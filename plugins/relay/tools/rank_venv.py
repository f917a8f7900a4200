"""A venv for the ranks, layered on Relay's environment (``relay spec venv DIR``).

``python -m venv --system-site-packages`` does not layer one on Relay's when Relay
itself runs in a venv (as ``make`` installs it): the new venv's system site is the base
interpreter's, which has no torch. This venv gets instead a ``.pth`` file that adds
Relay's site-packages after its own: what is ``pip install``-ed into it wins, the rest
(torch, NumPy, MLflow, tenacity) comes from Relay's environment. Its ``bin/python`` is
what the spec's ``entrypoint.python`` names.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from relay.core.exceptions import RelayError

LAYER_FILE = "relay-base.pth"  # in the new venv's site-packages
TIMEOUT_SECONDS = 300.0  # ensurepip on a loaded machine takes tens of seconds


def relay_site_folders() -> list[str]:
    """Return the site-packages folders of the interpreter Relay runs in."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def make_rank_venv(target: Path, *, with_pip: bool = True) -> Path:
    """Make a venv at ``target`` layered on Relay's environment; return its interpreter."""
    if target.exists() and any(target.iterdir()):
        raise RelayError(f"relay spec venv: expected a new or empty folder, found {target} "
                         "with files in it. Name another folder, or remove it first.")
    command = [sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]),
               str(target)]
    made = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS,
                          check=False)
    if made.returncode != 0:
        raise RelayError(f"relay spec venv: expected {' '.join(command)} to make the venv, "
                         f"it exited {made.returncode}: {made.stderr.strip()[-500:]}")
    python = target / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=True).stdout.strip()
    # A line that starts with "import" is run: addsitedir also reads Relay's own .pth files.
    lines = [f"import site; site.addsitedir({folder!r})\n" for folder in relay_site_folders()]
    (Path(site) / LAYER_FILE).write_text("".join(lines))
    return python
