"""The sandbox runtime option: config file, CLI override, refusal of unknown runtimes, and the seccomp
profile sandboxes get under runsc."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from sandboxd.config import load_config
from sandboxd.sandbox.runsc import RUNSC_ARGS, runsc_seccomp_profile


def test_runc_is_the_default(tmp_path: Path) -> None:
    assert load_config(state_dir=str(tmp_path)).sandbox.runtime == "runc"


def test_the_file_sets_it_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    config = tmp_path / "sandboxd.toml"
    config.write_text('[sandbox]\nruntime = "runsc"\npids = 64\n')
    assert load_config(config, state_dir=str(tmp_path)).sandbox.runtime == "runsc"
    overridden = load_config(config, state_dir=str(tmp_path), runtime="runc")
    assert overridden.sandbox.runtime == "runc" and overridden.sandbox.pids == 64  # the rest of [sandbox] kept
    assert load_config(state_dir=str(tmp_path), runtime="runsc").sandbox.runtime == "runsc"


@pytest.mark.parametrize("runtime", ["kata", "RUNSC", "", "runsc --debug"])
def test_an_unknown_runtime_is_refused(tmp_path: Path, runtime: str) -> None:
    with pytest.raises(ValueError, match="runtime"):
        load_config(state_dir=str(tmp_path), runtime=runtime)
    config = tmp_path / "sandboxd.toml"
    config.write_text(f"[sandbox]\nruntime = {json.dumps(runtime)}\n")
    with pytest.raises(ValueError, match="runtime"):
        load_config(config, state_dir=str(tmp_path))


def test_the_runsc_profile_is_dockers_but_for_clone3() -> None:
    docker_default = json.loads(resources.files("sandboxd.sandbox").joinpath("seccomp-docker-default.json")
                                .read_text())
    ours = json.loads(runsc_seccomp_profile())
    assert ours["defaultAction"] == docker_default["defaultAction"] == "SCMP_ACT_ERRNO"
    changed = [rule for rule in ours["syscalls"] if rule not in docker_default["syscalls"]]
    dropped = [rule for rule in docker_default["syscalls"] if rule not in ours["syscalls"]]
    assert changed == [{"names": ["clone3"], "action": "SCMP_ACT_ALLOW"}]
    assert [rule["names"] for rule in dropped] == [["clone3"]]
    # What makes namespaces and mounts need CAP_SYS_ADMIN (which sandboxes never have) is untouched.
    admin_only = [rule for rule in ours["syscalls"] if "unshare" in rule["names"]]
    assert admin_only and all(rule["includes"].get("caps") == ["CAP_SYS_ADMIN"] for rule in admin_only)
    assert {"mount", "setns", "umount2"} <= set(admin_only[0]["names"])


def test_the_registration_script_writes_the_arguments_the_daemon_checks() -> None:
    script = (Path(__file__).parents[2] / "docker" / "ensure-runsc.sh").read_text()
    written = json.loads(script.split('"runtimeArgs": ', 1)[1].split("}", 1)[0])
    assert written == list(RUNSC_ARGS)
