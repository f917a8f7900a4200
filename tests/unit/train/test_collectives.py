"""Forward collectives marked in the heartbeat: DDP's buffer broadcast, FSDP2's all-gathers.

A one-rank gloo group (a file store in tmp): the hooks' order is what matters, and it
is the same for one rank as for many.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from relay_train.collectives import StepPhases, mark_collectives
from relay_train.protocol.heartbeat import Phase


class Recorder:
    """A heartbeat writer that only records the phases entered (and the forward's events)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def enter(self, phase: Phase) -> None:
        self.events.append(phase.value)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def traced(net: nn.Module, events: list[str]) -> nn.Module:
    net[0].register_forward_pre_hook(lambda *_: events.append("forward"))
    return net


def with_buffers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def run(model: nn.Module, phases: StepPhases) -> None:
    phases.compute()
    model(torch.randn(3, 4)).sum().backward()


def test_ddps_buffer_broadcast_is_a_collective_then_the_forward_computes(group: None) -> None:
    beat = Recorder()
    phases = StepPhases(beat)  # type: ignore[arg-type]
    ddp = nn.parallel.DistributedDataParallel(traced(with_buffers(), beat.events))
    handles = mark_collectives(ddp, phases.wait, phases.resume_compute)
    assert len(handles) == 2
    run(ddp, phases)
    assert beat.events == ["compute", "collective", "compute", "forward"]


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated")
@pytest.mark.parametrize("kwargs", [{"broadcast_buffers": False}, {}])
def test_nothing_is_marked_where_ddp_broadcasts_nothing(group: None, kwargs: dict) -> None:
    beat = Recorder()
    net = with_buffers() if kwargs else nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ddp = nn.parallel.DistributedDataParallel(traced(net, beat.events), **kwargs)
    phases = StepPhases(beat)  # type: ignore[arg-type]
    assert mark_collectives(ddp, phases.wait, phases.resume_compute) == []
    run(ddp, phases)
    assert beat.events == ["compute", "forward"]


def test_each_fsdp2_modules_all_gather_is_bracketed(group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    beat = Recorder()
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    fully_shard(net[0])
    fully_shard(net)
    phases = StepPhases(beat)  # type: ignore[arg-type]
    assert len(mark_collectives(net, phases.wait, phases.resume_compute)) >= 4
    traced(net, beat.events)  # the layer's own work, after every pre-forward hook
    # Ours runs before fully_shard's own pre-forward hook (which all-gathers), then after.
    hooks = list(net._forward_pre_hooks.values())
    assert len(hooks) == 3 and hooks[0].__name__ == "collective"
    assert hooks[-1].__name__ == "compute"
    with torch.no_grad():  # the forward alone (a backward is the next test's)
        phases.compute()
        net(torch.randn(3, 4))
    assert beat.events == ["compute", "collective", "compute", "collective", "compute",
                           "forward"]


def test_fsdp2s_backward_collectives_run_in_the_collective_phase(
        group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group

    beat = Recorder()
    for name in ("foreach_all_gather", "foreach_reduce"):  # each collective, as it is issued
        real = getattr(fsdp_group, name)
        monkeypatch.setattr(fsdp_group, name, lambda *a, _real=real, _name=name, **k: (
            beat.events.append(_name), _real(*a, **k))[1])
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    phases = StepPhases(beat)  # type: ignore[arg-type]
    mark_collectives(net, phases.wait, phases.resume_compute)
    loss = net(torch.randn(3, 4)).sum()
    del beat.events[:]
    phases.compute()
    loss.register_hook(lambda grad: beat.events.append("backward") or grad)
    loss.backward()
    events = beat.events
    assert events[:2] == ["compute", "backward"] and events[-1] == "compute", events
    # One rank needs no all-gather (its shard is the whole); the pre-backwards that would
    # wait for one are bracketed all the same, and each reduce-scatter is issued inside.
    assert events.count("foreach_reduce") == 2, events
    assert events.count("collective") == 5, events  # 2 pre-, 2 post-backward, the final one
    for i, event in enumerate(events):  # each issued in a collective phase, entered before
        if event.startswith("foreach_"):
            phase = [e for e in events[:i] if e in ("compute", "collective")][-1]
            assert phase == "collective", (i, events)


def test_step_phases_enter_a_collective_once_and_compute_again_only_after_one() -> None:
    beat = Recorder()
    phases = StepPhases(beat)  # type: ignore[arg-type]
    phases.resume_compute()  # not in a collective: nothing to leave
    phases.compute()
    phases.wait()
    phases.wait()  # DDP calls its hook once per bucket
    phases.resume_compute()
    phases.compute()  # a new step restarts the compute clock
    assert beat.events == ["compute", "collective", "compute", "compute"]
