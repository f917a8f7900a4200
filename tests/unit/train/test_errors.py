"""The worker side's exceptions: one module, their built-in bases, re-exported for scripts."""

from __future__ import annotations

import subprocess
import sys

import relay_train
from relay_train import errors


def test_each_error_keeps_the_base_its_callers_catch() -> None:
    assert issubclass(errors.NotUnderRelayError, RuntimeError)
    assert issubclass(errors.DeviceError, RuntimeError)
    assert issubclass(errors.CorruptCheckpointError, Exception)
    assert not issubclass(errors.CorruptCheckpointError, RuntimeError)


def test_the_package_re_exports_every_error_without_torch() -> None:
    for name in errors.__all__:
        assert getattr(relay_train, name) is getattr(errors, name)
    # A script (or the agent) catching one must not pay for torch's import.
    code = ("import sys; sys.modules['torch'] = None; import relay_train; "
            "print(relay_train.CorruptCheckpointError.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "relay_train.errors"
