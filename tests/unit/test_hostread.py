"""read_file served from the host (sandboxd.sandbox.hostread): the executor's reply, byte for byte, or none.

The executor's own code is the reference, run on the same directory. Run as root (as the daemon is, so the
reader can take the sandbox user's credentials); elsewhere the reader declines every read, which is checked too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.sandbox import executor
from sandboxd.sandbox.hostread import HostReader

UID = GID = 1000  # the sandbox user of the tool image
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="taking the sandbox user's credentials needs root")


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Path]:
    tmp_path.chmod(0o755)
    ws = tmp_path / "ws"
    ws.mkdir()
    token = executor._workspace.set(str(ws))
    yield ws
    executor._workspace.reset(token)


def executor_reply(req: dict[str, object]) -> dict[str, object]:
    return executor.handle(executor.json.dumps({"op": "read_file", **req}).encode())


_names = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1,
                 max_size=40).filter(lambda name: name not in (".", "..") and len(name.encode()) < 250)


@root_only
@settings(max_examples=150, deadline=None)
@given(name=_names, data=st.binary(max_size=600) | st.text(max_size=300).map(str.encode),
       cap=st.integers(min_value=1, max_value=512), nested=st.booleans(), absolute=st.booleans())
def test_a_host_read_is_the_executors_reply_byte_for_byte(tmp_path_factory: pytest.TempPathFactory, name: str,
                                                          data: bytes, cap: int, nested: bool,
                                                          absolute: bool) -> None:
    base = tmp_path_factory.mktemp("base")
    base.chmod(0o755)
    ws = base / "ws"
    (ws / "sub").mkdir(parents=True)
    target = ws / "sub" / name if nested else ws / name
    target.write_bytes(data)
    (ws / "link").symlink_to("sub" if nested else ".")  # a relative symlink that stays inside
    path = ("sub/" if nested else "") + name
    req = {"path": f"/workspace/{path}" if absolute else path, "max_bytes": cap}
    token = executor._workspace.set(str(ws))
    try:
        expected = executor_reply(req)
        via_link = {"path": f"link/{name}", "max_bytes": cap}
        expected_via_link = executor_reply(via_link)
    finally:
        executor._workspace.reset(token)
    reader = HostReader(UID, GID)
    assert reader.read_file(ws, req) == expected
    assert reader.read_file(ws, via_link) == expected_via_link



@root_only
@settings(max_examples=100, deadline=None)
@given(names=st.lists(_names, min_size=0, max_size=8, unique=True),
       kinds=st.lists(st.sampled_from(["file", "dir", "link-in", "link-out", "fifo", "private"]), min_size=8,
                      max_size=8),
       where=st.sampled_from([None, ".", "sub", "/workspace", "/workspace/sub", "link/", "sub/../sub"]))
def test_a_host_listing_is_the_executors_reply_byte_for_byte(tmp_path_factory: pytest.TempPathFactory,
                                                             names: list[str], kinds: list[str],
                                                             where: str | None) -> None:
    base = tmp_path_factory.mktemp("base")
    base.chmod(0o755)
    ws = base / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "link").symlink_to("sub")
    for name, kind in zip(names, kinds, strict=False):  # more kinds than names
        entry = ws / "sub" / name
        if kind == "file":
            entry.write_bytes(name.encode() * 3)
        elif kind == "dir":
            entry.mkdir()
        elif kind == "link-in":
            entry.symlink_to("..")
        elif kind == "link-out":
            entry.symlink_to("/etc/passwd")
        elif kind == "fifo":
            os.mkfifo(entry)
        else:
            entry.write_text("x")
            entry.chmod(0o600)
    req = {"op": "list_dir", **({} if where is None else {"path": where}), "recursive": False}
    token = executor._workspace.set(str(ws))
    try:
        expected = executor.handle(executor.json.dumps(req).encode())
    finally:
        executor._workspace.reset(token)
    assert HostReader(UID, GID).list_dir(ws, req) == expected


@root_only
def test_a_listing_only_the_executor_can_answer_is_left_to_it(workspace: Path) -> None:
    (workspace / "d").mkdir()
    (workspace / "d" / "f").write_text("x")
    (workspace / "out").symlink_to("..")
    (workspace / "abs").symlink_to("/workspace/d")
    (workspace / "nosearch").mkdir()
    (workspace / "nosearch" / "f").write_text("x")
    (workspace / "nosearch").chmod(0o744)  # the sandbox user reads the names but cannot lstat them
    (workspace / "noread").mkdir(mode=0o711)
    reader = HostReader(UID, GID)
    assert reader.list_dir(workspace, {"path": "d"}) is not None
    for path in ("out", "abs", "nosearch", "noread", "d/f", "missing", "/etc", "../x"):
        assert reader.list_dir(workspace, {"path": path}) is None, path
    assert reader.list_dir(workspace, {"path": "d", "recursive": True}) is None

@root_only
def test_whatever_only_the_executor_can_answer_is_left_to_it(workspace: Path) -> None:
    """Escapes, absolute symlinks, directories, FIFOs, missing files and files the sandbox user may not read:
    the reader declines (None) and the executor answers as it always did."""
    secret = workspace.parent / "secret"
    secret.write_text("host secret\n")
    (workspace / "out").symlink_to("../secret")
    (workspace / "abs_out").symlink_to(str(secret))
    (workspace / "abs_in").symlink_to("/workspace/plain")  # fine in the container; not provable here
    (workspace / "plain").write_text("plain\n")
    (workspace / "dir").mkdir()
    os.mkfifo(workspace / "fifo")
    (workspace / "private").write_text("root's\n")
    (workspace / "private").chmod(0o600)
    (workspace / "shut").mkdir()
    (workspace / "shut" / "f").write_text("x\n")
    (workspace / "shut").chmod(0o600)  # readable listing, no search: the file inside cannot be opened
    reader = HostReader(UID, GID)
    assert reader.read_file(workspace, {"path": "plain", "max_bytes": 100})["stdout"] == "plain\n"
    for path in ("out", "abs_out", "abs_in", "dir", "fifo", "missing", "missing/../plain", "private", "shut/f",
                 ".", "/workspace", "/etc/passwd", "../secret", "plain/"):
        assert reader.read_file(workspace, {"path": path, "max_bytes": 100}) is None, path
    assert executor_reply({"path": "out", "max_bytes": 100})["error"] == "path_escape"


@root_only
def test_the_reading_thread_gets_its_own_identity_back(workspace: Path) -> None:
    (workspace / "f").write_text("x")
    reader = HostReader(UID, GID)
    before = _identity()
    seen: list[dict[str, str]] = []

    def other() -> None:  # another thread meanwhile keeps the daemon's identity throughout
        seen.append(_identity())

    for path in ("f", "missing", "../escape"):
        reader.read_file(workspace, {"path": path, "max_bytes": 10})
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert _identity() == before and all(identity == before for identity in seen)


def test_without_root_every_read_goes_to_the_executor(workspace: Path) -> None:
    (workspace / "f").write_text("x")
    reader = HostReader(UID, GID)
    assert reader.usable == (os.geteuid() == 0)
    if not reader.usable:
        assert reader.read_file(workspace, {"path": "f", "max_bytes": 10}) is None


def _identity() -> dict[str, str]:
    with open("/proc/thread-self/status") as fh:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in fh) if k in ("Uid", "Gid", "Groups")}


@root_only
def test_a_device_node_is_never_opened_from_the_host(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only looked at (O_PATH): opened on the host, a device would be outside the container's device rules."""
    import stat as stat_module

    os.mknod(workspace / "null", 0o666 | stat_module.S_IFCHR, os.makedev(1, 3))
    reader = HostReader(UID, GID)
    opened: list[tuple[str, int]] = []
    real = reader._open

    def spy(root: int, path: str, flags: int) -> int:
        opened.append((path, flags))
        return real(root, path, flags)

    monkeypatch.setattr(reader, "_open", spy)
    assert reader.read_file(workspace, {"path": "null", "max_bytes": 10}) is None
    assert opened and all(flags & os.O_PATH for _, flags in opened), opened


@root_only
def test_a_daemon_that_cannot_take_the_sandbox_users_identity_reads_nothing_from_the_host(workspace: Path) -> None:
    """setfsuid fails silently without CAP_SETUID: a reader that trusted it would read as root."""
    import subprocess
    import sys

    (workspace / "private").write_text("root's\n")
    (workspace / "private").chmod(0o600)
    probe = ("import sys; from pathlib import Path; from sandboxd.sandbox.hostread import HostReader; "
             f"r = HostReader({UID}, {GID}); "
             "print(r.read_file(Path(sys.argv[1]), {'path': 'private', 'max_bytes': 100}))")
    out = subprocess.run(["setpriv", "--bounding-set=-setuid", sys.executable, "-c", probe, str(workspace)],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]).stdout
    assert out.strip() == "None", out


@root_only
def test_a_read_bounded_by_at_most_declines_what_is_larger_and_answers_the_rest_alike(workspace: Path) -> None:
    """`at_most` (reads answered on the daemon's socket thread): a file of more bytes, or a directory of more
    entries, is declined before it is read; at or under the bound the reply is the unbounded one."""
    (workspace / "small").write_bytes(b"x" * 100)
    (workspace / "edge").write_bytes(b"y" * 101)
    (workspace / "d").mkdir()
    for i in range(5):
        (workspace / "d" / f"f{i}").write_text("z")
    reader = HostReader(UID, GID)
    for path, size in (("small", 100), ("edge", 101)):
        req = {"path": path, "max_bytes": 1000}
        assert reader.read_file(workspace, req, at_most=101) == reader.read_file(workspace, req) is not None
        assert reader.read_file(workspace, req, at_most=size - 1) is None
    listing = {"path": "d"}
    assert reader.list_dir(workspace, listing, at_most=5) == reader.list_dir(workspace, listing) is not None
    assert reader.list_dir(workspace, listing, at_most=4) is None
    assert reader.list_dir(workspace, {"path": "."}, at_most=3) is not None  # small, edge, d
    assert reader.list_dir(workspace, {"path": "."}, at_most=2) is None


@root_only
def test_a_bounded_read_reads_no_more_than_its_bound(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the bound limits is the work on the daemon's socket thread, so it holds for what is read, not only
    for what fstat said: a file that grew after its fstat, a directory of many entries, are declined having
    read at most one byte or one entry past the bound."""
    from sandboxd.sandbox import hostread

    (workspace / "grown").write_bytes(b"g" * 5000)
    (workspace / "many").mkdir()
    for i in range(300):
        (workspace / "many" / f"f{i}").write_text("")
    reader = HostReader(UID, GID)
    sizes: list[int] = []
    real_read, real_fstat = hostread._read_up_to, os.fstat
    monkeypatch.setattr(hostread, "_read_up_to", lambda fd, size: sizes.append(size) or real_read(fd, size))
    # fstat as it was before the file grew
    monkeypatch.setattr(hostread.os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 10, *real_fstat(fd)[7:])))
    assert reader.read_file(workspace, {"path": "grown", "max_bytes": 1000}, at_most=100) is None
    assert sizes == [101]
    monkeypatch.setattr(hostread.os, "fstat", real_fstat)
    taken: list[int] = []
    real_scandir = os.scandir

    class Counting:
        def __init__(self, fd: int) -> None:
            self.entries = real_scandir(fd)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.entries.close()

        def __iter__(self) -> Iterator[os.DirEntry[str]]:
            for entry in self.entries:
                taken.append(1)
                yield entry

    monkeypatch.setattr(hostread.os, "scandir", Counting)
    assert reader.list_dir(workspace, {"path": "many"}, at_most=10) is None
    assert len(taken) == 11
    listed = reader.list_dir(workspace, {"path": "many"}, at_most=300)
    assert listed is not None and listed == reader.list_dir(workspace, {"path": "many"})
