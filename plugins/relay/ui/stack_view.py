"""The culprit's stack as a person reads it: their own frames first, the rest folded.

A fault's evidence (``relay.recover.evidence.evidence_summary``) keeps each rank's
threads as ``file:line in function: code`` lines, innermost last, as a traceback
prints them; a rank that only answered from C keeps faulthandler's text, innermost
first. Under the user's frame that matters lie some thirty frames of Relay's
agent, multiprocessing and torch. Here each frame is classified by its file
(:func:`frame_kind`) and each thread split into the user's frames, innermost
first, and the folded rest. Pure functions of the recorded evidence: anyone who
can write to MLflow writes it, so whatever does not parse shows as plain text.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

import relay
import relay_train.protocol


class FrameKind(StrEnum):
    """Whose code a frame runs: only ``USER`` frames are shown unfolded."""

    USER = "user"
    RELAY = "Relay"
    TORCH = "torch"
    LIBRARY = "other libraries"
    STDLIB = "the standard library"


# A traceback line as evidence.py writes it, and faulthandler's own.
TRACEBACK_LINE = re.compile(
    r"^(?P<file>.+?):(?P<line>\d+) in (?P<function>[^:\s]+)(?:: (?P<code>.*))?$")
FAULTHANDLER_LINE = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>\S+)')
SITE_PACKAGES = re.compile(r"/(?:site|dist)-packages/(?P<top>[^/]+)/")
STDLIB_DIR = re.compile(r"/lib/python3\.\d+/(?!(?:site|dist)-packages/)")
TORCH_PACKAGES = frozenset({"torch", "functorch", "torchgen", "triton"})
# The folders a checkout or a wheel keeps Relay's packages in (pyproject.toml: relay_train
# is the repository's training/ folder). Scripts under examples/ and baselines/ are users'.
RELAY_FOLDERS = {"relay_train": ("training", "relay_train"), "relay": ("relay",)}
USER_FOLDERS = ("examples/", "baselines/")
SHOWN_WITHOUT_USER_FRAMES = 3  # a thread with no user frame: its innermost few stay open


@cache
def relay_files() -> frozenset[str]:
    """Return the paths of Relay's own modules, each as ``folder/relative.py``."""
    roots = {"relay_train": Path(relay_train.protocol.__file__).parent.parent,
             "relay": Path(relay.__file__).parent}
    found = set()
    for package, root in roots.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(USER_FOLDERS):
                found.update(f"{folder}/{rel}" for folder in RELAY_FOLDERS[package])
    return frozenset(found)


def frame_kind(file: str, relay_modules: frozenset[str] | None = None) -> FrameKind:
    """Return whose code ``file`` is (a path as the rank recorded it, on its machine)."""
    path = file.replace("\\", "/")
    if path.startswith("<frozen"):
        return FrameKind.STDLIB
    installed = SITE_PACKAGES.search(path)
    if installed:
        top = installed["top"]
        if top in RELAY_FOLDERS:
            rel = path[installed.end():]
            return FrameKind.USER if rel.startswith(USER_FOLDERS) else FrameKind.RELAY
        return FrameKind.TORCH if top in TORCH_PACKAGES else FrameKind.LIBRARY
    if STDLIB_DIR.search(path):
        return FrameKind.STDLIB
    modules = relay_files() if relay_modules is None else relay_modules
    parts = path.split("/")
    for depth in range(2, len(parts)):  # the shortest tail first: folder/module.py
        if "/".join(parts[-depth:]) in modules:
            return FrameKind.RELAY
    return FrameKind.USER


@dataclass(frozen=True)
class Frame:
    """One frame of a recorded stack."""

    file: str
    line: int
    function: str
    code: str
    kind: FrameKind

    @property
    def where(self) -> str:
        """Return ``function (file.py:line)``, the short form."""
        return f"{self.function} ({Path(self.file).name}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's stack, read innermost first: the user's frames, then the folded rest."""

    title: str
    shown: list[Frame]
    folded: list[Frame]
    raw: list[str] = field(default_factory=list)  # lines that did not parse, as recorded
    culprit: bool = False  # a thread of the culprit rank (it may not have answered)

    @property
    def folded_label(self) -> str:
        """Return e.g. ``31 more frames: Relay 18, the standard library 11, torch 2``."""
        counts = Counter(f.kind.value for f in self.folded)
        parts = ", ".join(f"{kind} {n}" for kind, n in counts.most_common())
        return f"{len(self.folded)} more frames: {parts}"


def parse_line(text: str, relay_modules: frozenset[str] | None = None) -> Frame | None:
    """Return the frame of one recorded line (either format), or None if it is not one."""
    match = FAULTHANDLER_LINE.match(text) or TRACEBACK_LINE.match(text)
    if match is None:
        return None
    file = match["file"]
    code = match.groupdict().get("code") or ""
    return Frame(file, int(match["line"]), match["function"], code,
                 frame_kind(file, relay_modules))


def fold(frames: list[Frame]) -> tuple[list[Frame], list[Frame]]:
    """Split frames (innermost first) into the shown user frames and the folded rest;
    a thread with no user frame keeps its innermost few shown."""
    user = [f for f in frames if f.kind is FrameKind.USER]
    if not user:
        return frames[:SHOWN_WITHOUT_USER_FRAMES], frames[SHOWN_WITHOUT_USER_FRAMES:]
    return user, [f for f in frames if f.kind is not FrameKind.USER]


def thread_stack(title: str, lines: list[Any], innermost_last: bool = True,
                 relay_modules: frozenset[str] | None = None,
                 culprit: bool = False) -> ThreadStack:
    """Return one thread's recorded lines as a :class:`ThreadStack`."""
    frames: list[Frame] = []
    raw: list[str] = []
    for line in lines:
        frame = parse_line(str(line), relay_modules)
        if frame is not None:
            frames.append(frame)
        elif str(line).strip():
            raw.append(str(line))
    if innermost_last:
        frames.reverse()
    shown, folded = fold(frames)
    return ThreadStack(title, shown, folded, raw, culprit)


def _rank_title(entry: dict[str, Any], thread: str) -> str:
    who = f"rank {entry.get('rank')}"
    if entry.get("node"):
        who += f" on {entry.get('node')}"
    if entry.get("culprit"):
        who += " (the culprit)"
    return f"{who}, {thread} thread" if thread == "main" else f"{who}, thread {thread}"


def _entry_stacks(entry: dict[str, Any], relay_modules: frozenset[str] | None) -> list[ThreadStack]:
    culprit = entry.get("culprit") is True
    if isinstance(entry.get("threads"), dict):
        return [thread_stack(_rank_title(entry, str(name)), list(lines), True, relay_modules,
                             culprit)
                for name, lines in entry["threads"].items() if isinstance(lines, list)]
    if isinstance(entry.get("faulthandler"), list):  # C-level dump: innermost first already
        return [thread_stack(_rank_title(entry, "every") + " (faulthandler, from C)",
                             entry["faulthandler"], False, relay_modules, culprit)]
    return []


def stacks_of(evidence_stacks: object,
              relay_modules: frozenset[str] | None = None) -> tuple[list[ThreadStack], str | None]:
    """Return the recorded ranks' threads (the culprit's main thread first), or, for a
    record of another shape, its text as recorded."""
    if evidence_stacks is None:
        return [], None
    if isinstance(evidence_stacks, str):
        return [], evidence_stacks
    stacks: list[ThreadStack] = []
    if isinstance(evidence_stacks, list) and all(isinstance(e, dict) for e in evidence_stacks):
        entries = sorted(evidence_stacks, key=lambda e: not e.get("culprit"))
        for entry in entries:
            stacks.extend(_entry_stacks(entry, relay_modules))
    if not stacks:
        return [], json.dumps(evidence_stacks, indent=1, default=str)
    return stacks, None
