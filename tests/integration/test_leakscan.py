"""Leak scans find a planted secret wherever state is kept (SQLite WAL, logs, containers, images), and stop
finding it once it is really gone."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import docker
from sandboxd.client import Client
from sandboxd.config import DEFAULT_IMAGE, load_config
from sandboxd.revocation import leakscan
from sandboxd.revocation.leakscan import LeakReport, needles_for, scan_container, scan_images, scan_paths
from sandboxd.sandbox.containers import ContainerManager
from sandboxd.sandbox.runsc import runsc_seccomp_profile
from tests.integration.conftest import DaemonProcess, both_runtimes

SECRET = 'tok-"Ωmega"-7781-revoke-me'
PLAIN = "sbx-leak-9f3c2e71d0"
IMAGE = DEFAULT_IMAGE


def locations(report: LeakReport) -> set[str]:
    return {hit.location for hit in report.hits}


# Host paths ------------------------------------------------------------------------------------


def test_needles_cover_the_usual_encodings() -> None:
    needles = needles_for(SECRET)
    assert SECRET.encode() in needles
    assert SECRET.encode("utf-16-le") in needles
    assert json.dumps(SECRET)[1:-1].encode() in needles
    assert msgspec.msgpack.encode(SECRET) in needles
    assert len(needles) == len(set(needles))
    assert needles_for("plain") == [b"plain", "plain".encode("utf-16-le"), "plain".encode("utf-16-be"),
                                    msgspec.msgpack.encode("plain")]
    assert needles_for("a b")[-1] == b"a%20b" and needles_for() == []


def test_sqlite_wal_leak_is_found_then_gone_after_secure_delete(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE artifacts (id INTEGER PRIMARY KEY, content TEXT)")
        conn.execute("INSERT INTO artifacts (content) VALUES (?)", ("kept row",))
        conn.execute("INSERT INTO artifacts (content) VALUES (?)", (f"observation: {SECRET}",))

        before = scan_paths(needles_for(SECRET), [tmp_path])
        assert str(db) + "-wal" in locations(before), before
        assert before.locations_checked == 3  # the db, its -wal and its -shm
        assert not before.skipped

        conn.execute("PRAGMA secure_delete=ON")
        conn.execute("DELETE FROM artifacts WHERE content LIKE 'observation:%'")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

        after = scan_paths(needles_for(SECRET), [tmp_path])
        assert after.hits == [] and after.clean
        assert after.locations_checked == 3
        assert conn.execute("SELECT content FROM artifacts").fetchall() == [("kept row",)]
    finally:
        conn.close()


def test_log_hits_in_every_encoding_with_exact_offsets(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "daemon.log"
    log.parent.mkdir()
    lines = [
        b"2024-01-01 start\n",
        json.dumps({"event": "observation", "text": SECRET}).encode() + b"\n",
        b"plain: " + SECRET.encode() + b"\n",
        b"utf16: " + SECRET.encode("utf-16-le") + b"\n",
    ]
    log.write_bytes(b"".join(lines))
    (tmp_path / "logs" / "other.log").write_text("nothing here\n")
    needles = needles_for(SECRET)
    report = scan_paths(needles, [tmp_path])
    data = log.read_bytes()
    found = {(hit.offset, needles[hit.needle]) for hit in report.hits}
    assert found == {(data.index(needle), needle) for needle in needles if needle in data}
    assert {hit.location for hit in report.hits} == {str(log)}
    assert report.locations_checked == 2


@pytest.mark.parametrize("chunk", [3, 7, 16, 64])
def test_matches_across_chunk_boundaries_are_found_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(leakscan, "CHUNK_BYTES", chunk)
    data = b"x" * 5 + b"abcabcab" + b"y" * 9 + b"abcab" + b"z" * 3 + b"abc"
    (tmp_path / "f").write_bytes(data)
    needles = [b"abcab", b"c"]
    report = scan_paths(needles, [tmp_path])
    # "c" also occurs in the test directory's name; only the file's content matters here.
    found = sorted((hit.needle, hit.offset) for hit in report.hits if hit.part == "content")
    expected = sorted(
        (i, pos) for i, needle in enumerate(needles) for pos in range(len(data)) if data.startswith(needle, pos)
    )
    assert found == expected


def test_symlinks_are_not_followed_but_their_names_are_searched(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(PLAIN)
    root = tmp_path / "root"
    root.mkdir()
    (root / "link-to-outside").symlink_to(outside)
    (root / "file-link").symlink_to(outside / "secret.txt")
    (root / f"named-{PLAIN}").write_text("harmless")
    (root / "points-at-name").symlink_to(f"/nowhere/{PLAIN}")
    os.mkfifo(root / "fifo")  # must be skipped, not read (reading it would block)

    report = scan_paths([PLAIN.encode()], [root])
    assert {(hit.location, hit.part) for hit in report.hits} == {
        (str(root / f"named-{PLAIN}"), "name"),
        (str(root / "points-at-name"), "name"),
    }
    assert report.locations_checked == 1 and not report.skipped


def test_missing_roots_are_ignored_and_a_single_file_root_works(tmp_path: Path) -> None:
    target = tmp_path / "one.bin"
    target.write_bytes(b"\0" + PLAIN.encode())
    report = scan_paths([PLAIN.encode()], [tmp_path / "absent", target])
    assert [(hit.location, hit.offset) for hit in report.hits] == [(str(target), 1)]


def tar_bytes(members: dict[str, bytes], mode: str = "w") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tar:  # type: ignore[call-overload]
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return out.getvalue()


def test_nested_and_gzipped_tars_are_opened() -> None:
    layer = tar_bytes({"tmp/notes.txt": b"header " + PLAIN.encode(), "./.hidden": PLAIN.encode()}, "w:gz")
    image = tar_bytes({"abc123/layer.tar.gz": layer, "corrupt.gz": b"\x1f\x8b" + b"\xff" * 600, "ok": b"fine"})
    report = LeakReport()
    leakscan._scan_tar(io.BytesIO(image), "image:x:", leakscan._Matcher([PLAIN.encode()], report))
    assert [(hit.location, hit.offset) for hit in report.hits] == [
        ("image:x:abc123/layer.tar.gz!/tmp/notes.txt", 7),
        ("image:x:abc123/layer.tar.gz!/.hidden", 0),
    ]
    assert len(report.skipped) == 1 and report.skipped[0].startswith("image:x:corrupt.gz:")
    assert report.locations_checked == 3  # the two layer members and "ok"; the corrupt blob is skipped


def test_empty_needles_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        scan_paths([], [tmp_path])
    with pytest.raises(ValueError):
        scan_paths([b""], [tmp_path])


# Docker ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> docker.DockerClient:
    client = docker.from_env()
    client.ping()
    return client


@pytest.fixture
def tmp_containers(engine: docker.DockerClient) -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for container in made:
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass


@pytest.fixture
def tmp_images(engine: docker.DockerClient) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for image_id in made:
        try:
            engine.images.remove(image_id, force=True)
        except docker.errors.ImageNotFound:
            pass


def run_container(engine: docker.DockerClient, tmp_containers: list[Any], runtime: str = "runc") -> Any:
    container = engine.containers.run(
        IMAGE, ["sleep", "60"], detach=True, network_mode="none", tmpfs={"/scratch": "mode=1777"},
        runtime=runtime, security_opt=[f"seccomp={runsc_seccomp_profile()}"] if runtime == "runsc" else None,
    )
    tmp_containers.append(container)
    return container


def write(container: Any, path: str, text: str) -> None:
    result = container.exec_run(["sh", "-c", 'printf %s "$1" > "$0"', path, text])
    assert result.exit_code == 0, result.output


@pytest.mark.docker
@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_container_files_are_found(engine: docker.DockerClient, tmp_containers: list[Any], runtime: str) -> None:
    container = run_container(engine, tmp_containers, runtime)
    write(container, "/tmp/notes.txt", f"remember: {PLAIN}\n")
    write(container, "/var/tmp/cache.json", json.dumps({"v": PLAIN}))  # only diff() points here
    write(container, "/scratch/buffer", PLAIN)  # tmpfs: only a tar run inside the container sees it
    write(container, "/tmp/clean.txt", "nothing")

    report = scan_container(container, needles_for(PLAIN))
    prefix = f"container:{container.short_id}:"
    assert {(hit.location, hit.offset) for hit in report.hits} == {
        (prefix + "/tmp/notes.txt", len("remember: ")),
        (prefix + "/var/tmp/cache.json", len('{"v": "')),
        (prefix + "/scratch/buffer", 0),
    }
    assert report.locations_checked >= 4
    assert not report.skipped


@pytest.mark.docker
@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_clean_container_has_no_hits(engine: docker.DockerClient, tmp_containers: list[Any], runtime: str) -> None:
    container = run_container(engine, tmp_containers, runtime)
    write(container, "/tmp/other.txt", "unrelated")
    report = scan_container(container, needles_for(PLAIN))
    assert report.hits == [] and report.clean
    assert report.locations_checked >= 1


@pytest.mark.docker
def test_saved_image_layers_are_searched(
    engine: docker.DockerClient, tmp_containers: list[Any], tmp_images: list[str]
) -> None:
    container = run_container(engine, tmp_containers)
    write(container, "/tmp/notes.txt", f"remember: {PLAIN}\n")
    image = container.commit()
    tmp_images.append(image.id)

    report = scan_images(engine, [image.id, "sha256:" + "0" * 64], needles_for(PLAIN))
    hits = [hit for hit in report.hits if hit.location.endswith("!/tmp/notes.txt")]
    assert len(hits) == 1 and hits[0].offset == len("remember: ")
    assert hits[0].location.startswith(f"image:{image.id}:")
    assert report.locations_checked > 100  # the base layers' files were searched too


@pytest.mark.docker
@both_runtimes
def test_a_sessions_scratch_space_is_scanned_under_its_runtime(daemon: DaemonProcess, client: Client, session: str,
                                                               runtime: str) -> None:
    """The scan a revocation runs over /tmp and /dev/shm finds what a tool left there, under either runtime."""
    client.call(session, "python", {"code": f"open('/tmp/copy.txt', 'w').write('x' + {PLAIN!r}); "
                                            f"open('/dev/shm/seg', 'w').write({PLAIN!r})"})
    manager = ContainerManager(load_config(state_dir=str(daemon.state_dir), runtime=runtime))
    report = manager.scan_scratch(session, needles_for(PLAIN))
    assert {(hit.location, hit.offset) for hit in report.hits} == {("/tmp/copy.txt", 1), ("/dev/shm/seg", 0)}
    assert not report.skipped
    pid = manager.container(session).attrs["State"]["Pid"]
    host_view = scan_paths(needles_for(PLAIN), [Path(f"/proc/{pid}/root/tmp")])
    # Under gVisor the tmpfs lives in its kernel: the host's view of the sandbox shows none of it.
    assert bool(host_view.hits) == (runtime == "runc")
    client.call(session, "shell", {"command": "rm /tmp/copy.txt /dev/shm/seg"})
    assert manager.scan_scratch(session, needles_for(PLAIN)).hits == []


@pytest.mark.docker
def test_a_sandbox_started_again_is_scanned_at_its_new_root(daemon: DaemonProcess, client: Client,
                                                            session: str) -> None:
    """The scan remembers the sandbox's init process rather than asking the engine each time: a sandbox
    that stopped and started again (another init process) must be found again, not scanned where it was."""
    manager = ContainerManager(load_config(state_dir=str(daemon.state_dir), runtime="runc"))
    assert manager.scan_scratch(session, needles_for(PLAIN)).hits == []  # remembers the first init process
    container = manager.container(session)
    first = container.attrs["State"]["Pid"]
    container.restart(timeout=0)
    container.reload()
    assert container.attrs["State"]["Pid"] != first
    write(container, "/tmp/after-restart.txt", PLAIN)
    report = manager.scan_scratch(session, needles_for(PLAIN))
    assert [(hit.location, hit.offset) for hit in report.hits] == [("/tmp/after-restart.txt", 0)]
    container.stop(timeout=0)
    assert manager.scan_scratch(session, needles_for(PLAIN)).hits == []  # stopped: its tmpfs is gone
