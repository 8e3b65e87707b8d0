"""Leak scans: does a revoked target still occur anywhere the daemon or the agent keeps state?

Forgetting is physical, so the check is a byte search, not a query: over host paths (SQLite files
with their `-wal` and `-shm`, logs, snapshot layer directories), over the files of a container, and
over saved images. A target is searched in every encoding it is likely to be stored in
(`needles_for`). File names and symlink targets are searched too, since a path can carry a value.

A report lists what it could not read in `skipped`: an unreadable file is not a clean one, and the
caller decides whether that fails the check. Hits never hold the needle, only its index in the list
the caller passed, so a report can be logged without re-storing the target.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import posixpath
import stat
import tarfile
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

import docker.errors
import msgspec

from sandboxd.revocation.bytefind import half_of, positions

CHUNK_BYTES = 1 << 20
#: container paths scanned as whole trees, besides every tmpfs mount and every path `diff()` reports
CONTAINER_PATHS = ("/sandbox", "/tmp", "/run/sandboxd", "/home")
# Image layers are tars inside the image tar; deeper nesting (a tar the agent wrote, inside a
# layer) is still searched, as raw bytes, which finds its uncompressed members anyway.
_MAX_TAR_DEPTH = 2
_GO_MODE_DIR = 1 << 31
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class Hit(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One occurrence of a needle: where, at which byte offset, and which needle (its index)."""

    location: str
    offset: int
    needle: int
    part: Literal["content", "name"] = "content"
    """content: inside the file's bytes; name: in its path or symlink target (offset into that)."""


class LeakReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The outcome of a scan: how many locations were searched, every hit, and what could not be read."""

    locations_checked: int = 0
    hits: list[Hit] = []
    skipped: list[str] = []
    """Locations that could not be searched, each with the reason."""

    @property
    def clean(self) -> bool:
        """No hit, and nothing left unsearched."""
        return not self.hits and not self.skipped

    def extend(self, other: LeakReport) -> None:
        """Fold another report into this one."""
        self.locations_checked += other.locations_checked
        self.hits.extend(other.hits)
        self.skipped.extend(other.skipped)


def needles_for(*forms: str) -> list[bytes]:
    """Every byte form the project could have written each form in: UTF-8, UTF-16 (both orders), JSON
    (ASCII-escaped, raw, and escaped twice), MessagePack and percent-encoding; no empty one, no repeat."""
    out: list[bytes] = []
    for form in forms:
        escaped = json.dumps(form)[1:-1]
        out += [form.encode("utf-8", "surrogatepass"), form.encode("utf-16-le", "surrogatepass"),
                form.encode("utf-16-be", "surrogatepass"), escaped.encode(),
                json.dumps(form, ensure_ascii=False)[1:-1].encode("utf-8", "surrogatepass"),
                json.dumps(escaped)[1:-1].encode(), msgspec.msgpack.encode(form),
                urllib.parse.quote(form, safe="").encode()]
    return [needle for needle in dict.fromkeys(out) if needle]


class _Matcher:
    """Searches byte streams for a fixed set of needles, chunk by chunk."""

    def __init__(self, needles: list[bytes], report: LeakReport) -> None:
        if not needles or any(not needle for needle in needles):
            raise ValueError("leak scan needs at least one needle, and no empty one")
        self.needles = needles
        # A match can straddle two chunks; carrying the last longest-needle-minus-one bytes over
        # finds it, and nothing shorter than a needle can match twice from inside the carry.
        self.carry = max(len(needle) for needle in needles) - 1
        self.report = report
        self.halves = [half_of(needle) if b"\x00" in needle else None for needle in needles]  # see bytefind

    def stream(self, read: Callable[[int], bytes], location: str) -> None:
        """Search everything `read` yields, counting it as one location."""
        self.report.locations_checked += 1
        self._chunks(iter(lambda: read(CHUNK_BYTES), b""), 0, location)

    def file(self, fd: int, location: str) -> None:
        """Search a regular file's stored bytes, one data extent at a time.

        Holes of sparse files (a session's quota image is one) store nothing and read as zeros:
        they are skipped, so a mostly empty 1 GiB image costs what its data costs.
        """
        self.report.locations_checked += 1
        size = os.fstat(fd).st_size
        position = 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole is left
                return
            try:
                end = os.lseek(fd, start, os.SEEK_HOLE)
            except OSError:
                end = size
            self._chunks(_extent_chunks(fd, start, end), start, location)
            position = end

    def _chunks(self, chunks: Iterable[bytes], base: int, location: str) -> None:
        """Search consecutive chunks starting at offset `base`, carrying enough to catch straddlers."""
        carried = b""
        for chunk in chunks:
            buffer = carried + chunk
            split: tuple[bytes, bytes] | None = None
            for index, needle in enumerate(self.needles):
                half = self.halves[index]
                if half is not None and split is None:
                    split = buffer[0::2], buffer[1::2]
                for position in positions(buffer, needle, half, split):
                    if position + len(needle) > len(carried):
                        self.report.hits.append(Hit(location=location, offset=base + position, needle=index))
            keep = min(len(buffer), self.carry)
            carried = buffer[len(buffer) - keep :] if keep else b""
            base += len(buffer) - keep

    def name(self, name: str | bytes, location: str) -> None:
        """Search a path or symlink target (not counted as a location of its own)."""
        raw = name if isinstance(name, bytes) else os.fsencode(name)
        for index, needle in enumerate(self.needles):
            position = raw.find(needle)
            while position != -1:
                self.report.hits.append(Hit(location=location, offset=position, needle=index, part="name"))
                position = raw.find(needle, position + 1)


def _extent_chunks(fd: int, start: int, end: int) -> Iterator[bytes]:
    """The bytes of [start, end) of a file, CHUNK_BYTES at a time."""
    offset = start
    while offset < end:
        chunk = os.pread(fd, min(CHUNK_BYTES, end - offset), offset)
        if not chunk:
            return
        offset += len(chunk)
        yield chunk


# Host paths ---------------------------------------------------------------------------------


def scan_paths(needles: list[bytes], roots: Iterable[Path]) -> LeakReport:
    """Search every regular file under `roots` (and their names) without following symlinks."""
    report = LeakReport()
    matcher = _Matcher(needles, report)
    for root in roots:
        if os.path.lexists(root):
            _scan_entry(Path(root), matcher)
    report.hits.sort(key=lambda hit: (hit.location, hit.offset, hit.needle))
    return report


def _scan_entry(path: Path, matcher: _Matcher) -> None:
    # An explicit stack instead of recursion: snapshot layer trees can be deep.
    stack = [path]
    while stack:
        current = stack.pop()
        location = str(current)
        matcher.name(current.name, location)
        try:
            info = os.lstat(current)
            if stat.S_ISLNK(info.st_mode):
                matcher.name(os.readlink(current), location)
            elif stat.S_ISDIR(info.st_mode):
                with os.scandir(current) as entries:
                    stack.extend(Path(entry.path) for entry in entries)
            elif stat.S_ISREG(info.st_mode):
                # O_NOFOLLOW: the file may have been swapped for a symlink since the lstat.
                fd = os.open(current, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    matcher.file(fd, location)
                finally:
                    os.close(fd)
            # Sockets, FIFOs and devices hold no stored bytes (and reading a FIFO would block).
        except OSError as exc:
            matcher.report.skipped.append(f"{location}: {exc.strerror or exc}")


# Tar streams (container archives, saved images) --------------------------------------------------


class _ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks, as the Docker SDK streams archives."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size


class _Peeked(io.RawIOBase):
    """A stream whose first bytes were already read to sniff its format."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            size = min(len(buffer), len(self._head))
            buffer[:size] = self._head[:size]
            self._head = self._head[size:]
            return size
        data = self._rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _scan_tar(stream: IO[bytes], prefix: str, matcher: _Matcher, depth: int = 0) -> None:
    """Search every member of a tar stream; members that are tars (or gzipped tars) are opened in turn."""
    try:
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            for member in archive:
                location = _join(prefix, member.name)
                matcher.name(member.name, location)
                if member.issym() or member.islnk():
                    matcher.name(member.linkname, location)
                handle = archive.extractfile(member) if member.isfile() else None
                if handle is not None:
                    _scan_member(handle, location, matcher, depth)
    except (tarfile.TarError, OSError, EOFError) as exc:
        matcher.report.skipped.append(f"{prefix or '<archive>'}: unreadable archive ({exc})")


def _scan_member(handle: IO[bytes], location: str, matcher: _Matcher, depth: int) -> None:
    try:
        head = handle.read(512)
        if head.startswith(_ZSTD_MAGIC):
            # The standard library cannot decompress zstd, and its raw bytes hide the content.
            matcher.report.skipped.append(f"{location}: zstd-compressed, not searched")
            return
        stream: IO[bytes] = io.BufferedReader(_Peeked(head, handle))
        if head.startswith(b"\x1f\x8b"):
            stream = io.BufferedReader(gzip.GzipFile(fileobj=stream, mode="rb"))
            head = stream.peek(512)[:512]
        if depth < _MAX_TAR_DEPTH and len(head) >= 262 and head[257:262] == b"ustar":
            _scan_tar(stream, location + "!", matcher, depth + 1)
        else:
            matcher.stream(stream.read, location)
    except (OSError, EOFError) as exc:
        matcher.report.skipped.append(f"{location}: {exc}")


def _join(prefix: str, name: str) -> str:
    if not prefix.endswith("!"):
        return f"{prefix}{name}"
    # Members of a nested tar are named relative to its root, often with a leading "./".
    relative = name[2:] if name.startswith("./") else name.lstrip("/")
    return f"{prefix}/{relative}" if relative not in ("", ".") else prefix


# Containers and images ----------------------------------------------------------------------


def scan_container(container: Any, needles: list[bytes], paths: Iterable[str] = CONTAINER_PATHS) -> LeakReport:
    """Search a container's state directories, its tmpfs mounts and every file `diff()` reports added or changed."""
    report = LeakReport()
    matcher = _Matcher(needles, report)
    container.reload()
    label = f"container:{container.short_id}:"
    tmpfs = _tmpfs_mounts(container)
    roots = list(dict.fromkeys([*paths, *tmpfs]))
    for root in roots:
        if any(_under(root, mount) for mount in tmpfs):
            _scan_via_exec(container, root, label, matcher)
        else:
            _scan_archive(container, root, label, matcher)
    changes = [change for change in container.diff() or [] if isinstance(change.get("Path"), str)]
    changed_paths = [change["Path"] for change in changes]
    for change in changes:
        path = change["Path"]
        matcher.name(path, label + path)
        # Kind 2 is a deletion. A path with a changed child is a directory whose children are listed.
        if change.get("Kind") == 2 or any(_under(path, root) for root in roots):
            continue
        if not any(other != path and _under(other, path) for other in changed_paths):
            _scan_archive(container, path, label, matcher)
    report.hits.sort(key=lambda hit: (hit.location, hit.offset, hit.needle))
    return report


def scan_inside(container: Any, needles: list[bytes], paths: Iterable[str]) -> LeakReport:
    """Search paths of a running container with `tar` run inside it, located by their container paths.

    For what only the container's own kernel holds: a tmpfs under gVisor lives in the sandbox's memory,
    out of reach of the host's view of the container and of the engine's archive API alike.
    """
    report = LeakReport()
    matcher = _Matcher(needles, report)
    container.reload()
    for path in paths:
        _scan_via_exec(container, path, "", matcher)
    report.hits.sort(key=lambda hit: (hit.location, hit.offset, hit.needle))
    return report


def _scan_archive(container: Any, path: str, label: str, matcher: _Matcher) -> None:
    try:
        chunks, _ = container.get_archive(path)
    except docker.errors.NotFound:
        return
    except docker.errors.APIError as exc:
        matcher.report.skipped.append(f"{label}{path}: {exc}")
        return
    # The archive of /a/b names its members b, b/..., so the parent is the prefix.
    parent = posixpath.dirname(path.rstrip("/")) or "/"
    _scan_tar(io.BufferedReader(_ChunkReader(chunks)), label + parent.rstrip("/") + "/", matcher)


def _scan_via_exec(container: Any, path: str, label: str, matcher: _Matcher) -> None:
    """Archive a tmpfs path with tar inside the container: the engine's archive API shows tmpfs mounts empty."""
    if container.status != "running":
        # A stopped container's tmpfs is gone, and with it anything it held.
        return
    parent, name = posixpath.split(path.rstrip("/"))
    api = container.client.api
    exec_id = api.exec_create(container.id, ["tar", "-cf", "-", "-C", parent or "/", name])["Id"]
    errors: list[bytes] = []

    def stdout() -> Iterator[bytes]:
        for out, err in api.exec_start(exec_id, stream=True, demux=True):
            if err:
                errors.append(err)
            if out:
                yield out

    _scan_tar(io.BufferedReader(_ChunkReader(stdout())), label + (parent.rstrip("/") or "") + "/", matcher)
    exit_code = api.exec_inspect(exec_id).get("ExitCode")
    if exit_code:
        message = b"".join(errors).decode("utf-8", "replace").strip().replace("\n", "; ")
        matcher.report.skipped.append(f"{label}{path}: tar exited {exit_code}: {message[:500]}")


def _tmpfs_mounts(container: Any) -> list[str]:
    attrs = container.attrs
    mounts = list((attrs.get("HostConfig") or {}).get("Tmpfs") or {})
    mounts += [m["Destination"] for m in attrs.get("Mounts") or [] if m.get("Type") == "tmpfs"]
    if (attrs.get("HostConfig") or {}).get("Runtime") == "runsc":
        # gVisor mounts a tmpfs of its own kernel at /tmp when the container names none.
        mounts += ["/tmp", "/dev/shm"]
    return list(dict.fromkeys(mounts))


def _under(path: str, root: str) -> bool:
    path, root = path.rstrip("/") or "/", root.rstrip("/") or "/"
    return path == root or path.startswith(root if root == "/" else root + "/")


def scan_images(client: Any, image_ids: Iterable[str], needles: list[bytes]) -> LeakReport:
    """Search saved images (config, layers, and the files inside the layers); absent images are skipped silently."""
    report = LeakReport()
    matcher = _Matcher(needles, report)
    for image_id in image_ids:
        try:
            image = client.images.get(image_id)
        except docker.errors.ImageNotFound:
            continue
        _scan_tar(io.BufferedReader(_ChunkReader(image.save(named=False))), f"image:{image_id}:", matcher)
    report.hits.sort(key=lambda hit: (hit.location, hit.offset, hit.needle))
    return report
