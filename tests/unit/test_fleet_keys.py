"""The fleet's key directory, the node daemons' merged configuration, and the specs the fleet refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxd.auth import KeyFileError, ServerKeys, generate_keys, read_public_key
from sandboxd.config import load_config

pytest.importorskip("ray")

from sandboxd.fleet.keys import FleetKeys, node_config_text  # noqa: E402  (the fleet extra)
from sandboxd.fleet.nodes import NodeSpec  # noqa: E402


def test_keys_are_made_once_and_kept(tmp_path: Path) -> None:
    keys = FleetKeys.ensure(tmp_path / "keys")
    node, door = read_public_key(keys.node_public), read_public_key(keys.door_public)
    assert node != door and keys.clients.is_dir() and not list(keys.clients.iterdir())
    assert os.stat(keys.node_secret).st_mode & 0o777 == 0o600
    again = FleetKeys.ensure(tmp_path / "keys")  # a second door start, or a restart: the same keys
    assert (read_public_key(again.node_public), read_public_key(again.door_public)) == (node, door)
    assert again.door_curve()[0] == node


def test_half_a_pair_is_refused_not_remade(tmp_path: Path) -> None:
    keys = FleetKeys.ensure(tmp_path / "keys")
    keys.node_secret.unlink()
    with pytest.raises(KeyFileError, match="node.key_secret is missing"):
        FleetKeys.ensure(tmp_path / "keys")
    assert not keys.node_secret.exists()


def test_a_readable_secret_is_refused(tmp_path: Path) -> None:
    keys = FleetKeys.ensure(tmp_path / "keys")
    keys.door_secret.chmod(0o644)
    with pytest.raises(KeyFileError, match="readable by others"):
        FleetKeys.ensure(tmp_path / "keys")


def test_a_node_config_keeps_the_users_settings_and_serves_the_fleets_keys(tmp_path: Path) -> None:
    keys = FleetKeys.ensure(tmp_path / "keys")
    user = tmp_path / "conf" / "sandboxd.toml"
    user.parent.mkdir()
    operator_public, _ = generate_keys(tmp_path / "conf" / "ops", "alice")
    user.write_text('workers = 4\nimage = "tool:\\u00e9\\"x"\n[sandbox]\ncpus = 0.5\nnetwork = false\n'
                    '[firewall]\nadapter_timeout_s = 2.5\n[firewall.smtp]\nhost = "127.0.0.1"\nport = 2525\n'
                    '[auth]\nserver_secret_key_file = "mine.key_secret"\nclient_keys_dir = "mine"\n'
                    'operator_keys = ["ops/alice.key"]\n')
    merged = tmp_path / "node" / "node.toml"
    merged.parent.mkdir()
    merged.write_text(node_config_text(user, keys))
    config = load_config(merged, state_dir=str(tmp_path / "state"), endpoint="tcp://127.0.0.1:5555")
    mine = load_config(user, state_dir=str(tmp_path / "state"))
    assert (config.workers, config.image, config.sandbox, config.firewall) == \
        (mine.workers, mine.image, mine.sandbox, mine.firewall)
    assert config.auth.server_secret_key_file == str(keys.node_secret)
    assert config.auth.client_keys_dir == str(keys.clients)
    assert config.auth.operator_keys == [str(keys.door_public), str(operator_public)]  # anchored to the user's file
    served = ServerKeys.load(config.auth)  # what the node's daemon will load: every file readable and right
    assert served.public == read_public_key(keys.node_public)
    assert served.admits(read_public_key(keys.door_public)) and served.admits(read_public_key(operator_public))


def test_without_a_config_a_node_still_gets_the_fleets_auth(tmp_path: Path) -> None:
    keys = FleetKeys.ensure(tmp_path / "keys")
    merged = tmp_path / "node.toml"
    merged.write_text(node_config_text(None, keys))
    config = load_config(merged, state_dir=str(tmp_path / "state"), endpoint="tcp://127.0.0.1:5555")
    assert config.auth.operator_keys == [str(keys.door_public)]


def test_a_spec_the_fleet_cannot_serve_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give the fleet's key directory"):
        NodeSpec(state="postgresql://x@y/z", state_root=str(tmp_path), port=7000).check()
    with pytest.raises(ValueError, match="not a TCP port"):
        NodeSpec(state="postgresql://x@y/z", state_root=str(tmp_path), keys_dir=str(tmp_path), port=70000).check()
    bad = tmp_path / "bad.toml"
    bad.write_text('snapshot_backend = "zfs"\n')
    with pytest.raises(ValueError, match="invalid configuration"):
        NodeSpec(state="postgresql://x@y/z", state_root=str(tmp_path), config=str(bad)).check()


def test_fleet_serve_refuses_a_bad_spec_before_joining_ray(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "sandboxd.cli", "fleet", "serve", "--ray", "127.0.0.1:1",
                           "--state", "postgresql://x@127.0.0.1:1/z", "--state-root", str(tmp_path / "nodes"),
                           "--node-port", "7000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "sandboxd fleet serve:" in done.stderr and "give the fleet's key directory" in done.stderr
    assert "Traceback" not in done.stderr
