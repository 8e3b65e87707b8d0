"""The fleet's CURVE keys, in one directory every node can read, and the node daemons' configuration.

With a key directory the node daemons listen on tcp:// (the door can reach nodes on other hosts) and
admit only the door. Layout, made by the door on its first start (`FleetKeys.ensure`) and kept after:

- `node.key`, `node.key_secret`: the one server keypair every node's daemon serves CURVE with; the
  door pins `node.key`. One pair for all nodes: a node that joins needs nothing made for it.
- `door.key`, `door.key_secret`: the door's client keypair, an operator key on every node (the door
  forwards every client's requests, operators' ones included).
- `clients/`: the nodes' client allowlist, empty as made: only the door (an operator) gets in. A
  public key dropped there admits that client to every node directly, as a non-operator.

Secrets are 0600 files: the directory must be readable by the user the daemons run as, and by nobody
who should not act on every sandbox of the fleet.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from sandboxd.auth import KeyFileError, generate_keys, read_public_key, read_secret_key
from sandboxd.config import AuthConfig


@dataclass(frozen=True)
class FleetKeys:
    """The key directory's files, by role."""

    directory: Path

    @property
    def node_secret(self) -> Path:
        return self.directory / "node.key_secret"

    @property
    def node_public(self) -> Path:
        return self.directory / "node.key"

    @property
    def door_secret(self) -> Path:
        return self.directory / "door.key_secret"

    @property
    def door_public(self) -> Path:
        return self.directory / "door.key"

    @property
    def clients(self) -> Path:
        return self.directory / "clients"

    @classmethod
    def ensure(cls, directory: Path) -> FleetKeys:
        """The directory's keys, each pair made if neither of its files exists; KeyFileError if one is half there."""
        keys = cls(directory.resolve())
        for name, public, secret in (("node", keys.node_public, keys.node_secret),
                                     ("door", keys.door_public, keys.door_secret)):
            if not public.exists() and not secret.exists():
                generate_keys(keys.directory, name)
            elif not (public.exists() and secret.exists()):
                # Remaking one half would leave nodes and door with keys that do not match.
                raise KeyFileError(f"{public if secret.exists() else secret} is missing but its pair is in "
                                   f"{keys.directory}: restore it, or delete both to make a new pair")
        keys.clients.mkdir(mode=0o700, exist_ok=True)
        keys.door_curve()  # a secret readable by others, or a pair that does not match, is refused now
        read_secret_key(keys.node_secret)
        return keys

    def door_curve(self) -> tuple[str, str, str]:
        """(the nodes' public key, the door's public key, the door's secret key), as a CURVE client needs them."""
        public, secret = read_secret_key(self.door_secret)
        return read_public_key(self.node_public), public, secret

    def auth(self, operator_keys: list[str]) -> AuthConfig:
        """A node daemon's [auth]: the fleet's server key and allowlist; operators: the door and `operator_keys`."""
        return AuthConfig(server_secret_key_file=str(self.node_secret), client_keys_dir=str(self.clients),
                          operator_keys=[str(self.door_public), *operator_keys])


def node_config_text(user_config: Path | None, keys: FleetKeys) -> str:
    """The TOML a node daemon reads: the user's configuration with its [auth] replaced by the fleet's.

    The user's server key and allowlist are dropped, its operator keys kept: a node serves the fleet's
    key and admits the door and those operators, whatever a single daemon's configuration said.
    """
    raw: dict[str, object] = {}
    operators: list[str] = []
    if user_config is not None:
        with open(user_config, "rb") as fh:
            raw = tomllib.load(fh)
        section = raw.get("auth", {})
        named = section.get("operator_keys", []) if isinstance(section, dict) else []
        # The config file's relative paths are relative to it; the merged file lives elsewhere.
        operators = [str(user_config.parent / Path(str(f)).expanduser()) for f in named]
    auth = keys.auth(operators)
    raw["auth"] = {"server_secret_key_file": auth.server_secret_key_file, "client_keys_dir": auth.client_keys_dir,
                   "operator_keys": auth.operator_keys}
    return "".join(f"{_toml(key)} = {_toml(value)}\n" for key, value in raw.items())


def _toml(value: object) -> str:
    """A TOML value, tables inline (the standard library reads TOML but does not write it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes are TOML's basic-string escapes; TOML also forbids a raw DEL, which JSON leaves be.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"a configuration value of type {type(value).__name__} cannot be written back: {value!r}")
