"""Signed checkpoint manifests: HMAC-SHA256 with a deployment key kept outside MLflow.

A manifest's sha256s guard a checkpoint's bytes, but the manifest lives in the same
MLflow store as the checkpoint: whoever can write there could write both. So every
manifest also carries ``signature``, an HMAC-SHA256 over its whole content (step,
format, size, the sha256 of the file or of every DCP file, ``.metadata`` included,
parent, run, origin, ``key_id``) under a key MLflow never sees. Nothing is unpickled
before the signature and then the sha256s match.

Keys come as a :class:`KeyRing`: one key to sign with (``write``) and every key a
signature may be made with (``keys``, by id), so a rotated-out key still reads the
checkpoints it signed. On disk (a key file, a Kubernetes Secret, an Airflow Variable)
a ring is JSON: ``{"write": "k2", "keys": {"k2": "<secret>", "k1": "<old secret>"}}``.
Stdlib only, like the manifest it signs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay_train.protocol.env import ENV_CHECKPOINT_KEYS_FILE
from relay_train.protocol.launch import ResumeFrom
from relay_train.protocol.manifest import CheckpointManifest

MIN_KEY_CHARS = 32  # a generated key is 64 hex characters (32 random bytes)
KEYRING_FILE = "checkpoint-keys.json"  # the name of a key ring file (and of the Secret's key)


@dataclass(frozen=True)
class KeyRing:
    """The keys a deployment signs checkpoint manifests with: one writes, all read."""

    write: str  # the id of the key new manifests are signed with
    keys: dict[str, str] = field(default_factory=dict, hash=False)  # id -> secret

    def __post_init__(self) -> None:
        if self.write not in self.keys:
            raise ValueError(f"field write: expected the id of one of the keys "
                             f"({', '.join(sorted(self.keys)) or 'none'}), found {self.write!r}")
        short = sorted(k for k, v in self.keys.items() if len(v) < MIN_KEY_CHARS)
        if short:
            raise ValueError(f"field keys: key(s) {', '.join(short)} shorter than "
                             f"{MIN_KEY_CHARS} characters; generate one with "
                             "`python -c 'import secrets; print(secrets.token_hex(32))'`")

    @classmethod
    def generate(cls, key_id: str = "k1") -> KeyRing:
        """Return a ring of one new random key."""
        return cls(write=key_id, keys={key_id: secrets.token_hex(32)})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "key ring") -> KeyRing:
        """Parse a ring; raise ``ValueError`` naming ``where`` and the field when it is not one."""
        try:
            keys = raw["keys"]
            if not isinstance(keys, Mapping) or not keys:
                found = "an empty one" if isinstance(keys, Mapping) else type(keys).__name__
                raise ValueError(
                    f"field keys: expected an object {{key id: secret}}, found {found}")
            return cls(write=str(raw["write"]), keys={str(k): str(v) for k, v in keys.items()})
        except KeyError as exc:
            raise ValueError(f"{where}: field {exc.args[0]} missing; expected "
                             '{"write": KEY_ID, "keys": {KEY_ID: SECRET, ...}}') from exc
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc

    @classmethod
    def read(cls, path: Path) -> KeyRing:
        """Read a ring file; raise ``ValueError`` naming the file when it is not one."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"checkpoint key ring {path}: expected a JSON key ring, could not "
                             f"read it ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"checkpoint key ring {path}: expected a JSON object")
        return cls.from_dict(raw, f"checkpoint key ring {path}")

    def to_dict(self) -> dict[str, Any]:
        """Return the ring as JSON-ready data (secrets included: keep it private)."""
        return {"write": self.write, "keys": dict(self.keys)}

    def __repr__(self) -> str:  # never print a secret in a log or a traceback
        return f"KeyRing(write={self.write!r}, keys=[{', '.join(sorted(self.keys))}])"


def _payload(manifest: CheckpointManifest) -> bytes:
    """Return the bytes a signature covers: every field but the signature, canonical JSON."""
    fields = dataclasses.asdict(manifest)
    fields.pop("signature", None)
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _mac(secret: str, manifest: CheckpointManifest) -> str:
    return hmac.new(secret.encode(), _payload(manifest), hashlib.sha256).hexdigest()


def sign(manifest: CheckpointManifest, ring: KeyRing) -> CheckpointManifest:
    """Return ``manifest`` signed with the ring's writing key."""
    unsigned = dataclasses.replace(manifest, key_id=ring.write, signature="")
    return dataclasses.replace(unsigned, signature=_mac(ring.keys[ring.write], unsigned))


def signature_problem(manifest: CheckpointManifest, ring: KeyRing) -> str | None:
    """Return why ``manifest``'s signature does not hold under ``ring`` (None: it holds)."""
    if not manifest.signature:
        return ("unsigned: no signature (made by a Relay before signed checkpoints, or "
                "written by someone without the deployment key)")
    secret = ring.keys.get(manifest.key_id)
    if secret is None:
        return (f"signed with key {manifest.key_id!r}, which is not among the accepted keys "
                f"({', '.join(sorted(ring.keys))})")
    if not hmac.compare_digest(_mac(secret, manifest), manifest.signature):
        return f"bad signature: the manifest was not signed with key {manifest.key_id!r} as it is"
    return None


def launch_ring(inline: Mapping[str, Any]) -> KeyRing:
    """Return the ring a rank signs and verifies with: the launch file's ``checkpoint_keys``,
    else the file ``$RELAY_CHECKPOINT_KEYS_FILE`` names; raise ``ValueError`` if neither."""
    if inline:
        return KeyRing.from_dict(inline, "launch file field checkpoint_keys")
    path = os.environ.get(ENV_CHECKPOINT_KEYS_FILE, "").strip()
    if path:
        return KeyRing.read(Path(path))
    raise ValueError(
        "checkpoint keys: expected the launch file's field checkpoint_keys or the environment "
        f"variable {ENV_CHECKPOINT_KEYS_FILE} naming a key ring file; found neither. Relay's "
        "launchers set one of them; on Kubernetes, create the Secret the pods mount "
        "(docs/security.md, Signed checkpoints).")


def resume_problem(resume: ResumeFrom, ring: KeyRing) -> str | None:
    """Return why a resume point is not the one its signed manifest describes (None: it is).

    Checked before anything is fetched or loaded: the manifest's signature, then that the
    step, run, format and sha256s the rank will check the bytes against are the manifest's.
    """
    if not resume.manifest:
        return "unsigned: the resume point carries no signed manifest"
    try:
        manifest = CheckpointManifest.from_json(resume.manifest)
    except ValueError as exc:
        return str(exc)
    problem = signature_problem(manifest, ring)
    if problem is not None:
        return problem
    theirs = (manifest.step, manifest.run_id, manifest.format, manifest.sha256, manifest.files)
    ours = (resume.step, resume.run_id, resume.format, resume.sha256, resume.files)
    if theirs != ours:
        return ("the resume point's step, run, format or sha256s differ from its signed "
                "manifest's")
    return None
