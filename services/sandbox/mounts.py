"""The mounts a session's workspace is made of: its disk quota (a filesystem of the quota's size at
the session directory) and, for envs that start from a project tree, an overlay over it.

Two quota backends (`sandbox.disk_quota_backend`):

- **disk** (default): a sparse ext4 image file, `<root>/<session>.img` (mode 0600, root's: the
  session cannot reach it), made with `mkfs.ext4` and loop-mounted. The kernel enforces the size
  and the file count at write time (ENOSPC inside the command); the bytes are on the disk under
  `sandbox.workdir_root`, not in memory. An image costs about 0.1 s to make and mount and only
  the blocks written on disk (it is sparse), so `max_sessions * disk_quota_mb` may exceed the
  disk: the images of sessions that really fill their quota must fit it. Needs root and loop
  devices (`/dev/loop-control`); a container without them uses `tmpfs` or no quota.
- **tmpfs**: a size-capped tmpfs: no disk involved, but its pages are memory (and swap).

Both need root (mounting is CAP_SYS_ADMIN); `unmount` detaches lazily, and a loop device made by
mount(8) is released with the last reference to its filesystem.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Literal

QuotaBackend = Literal["disk", "tmpfs"]
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)


class MountError(RuntimeError):
    """A mount the workspace needs failed; the message says which setting avoids it."""


def mount_call(source: str, target: Path, fstype: str, flags: int, opts: str) -> None:
    if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags, opts.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} at {target}: {os.strerror(e)}")


def mount_tmpfs(path: Path, size_bytes: int, inodes: int, uid: int) -> None:
    """Mount a fresh tmpfs of `size_bytes` (and `inodes` files) at `path`, owned by `uid`, mode
    0700. nosuid/nodev: nothing inside can gain privileges; exec stays allowed (scripts, tests)."""
    opts = f"size={size_bytes},nr_inodes={inodes},mode=0700,uid={uid},gid={uid}"
    try:
        mount_call("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    except OSError as e:
        raise MountError(
            f"cannot mount the session's tmpfs for sandbox.disk_quota_mb at {path}: {e.strerror} "
            "(needs root with CAP_SYS_ADMIN); set sandbox.disk_quota_mb = 0 to run without a disk quota"
        ) from e


def _tool(name: str) -> str:
    """A system tool's path; sbin too, which a non-login PATH may lack."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") or name


def image_bytes(size_bytes: int, inodes: int) -> int:
    """The image that holds `size_bytes` of files: ext4's own tables (256 bytes an inode, ~3% for
    bitmaps, descriptors and blocks held back for delayed allocation) come on top."""
    return size_bytes + inodes * 256 + size_bytes // 32 + (256 << 10)


def mount_disk_image(path: Path, image: Path, size_bytes: int, inodes: int, uid: int) -> None:
    """Make a sparse ext4 image with room for `size_bytes` and `inodes` files at `image` and
    loop-mount it at `path` (nosuid, nodev), its root owned by `uid`, mode 0700. No journal (a
    session's files do not outlive it), no reserved blocks and no room to grow: the session gets
    the quota (1-6% more: what the kernel holds back varies with the size)."""
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, image_bytes(size_bytes, inodes))
    finally:
        os.close(fd)
    mkfs = [
        _tool("mkfs.ext4"), "-q", "-F", "-m", "0", "-b", "4096", "-N", str(inodes),
        "-O", "^has_journal,^resize_inode",
        "-E", f"root_owner={uid}:{uid},lazy_itable_init=1,nodiscard", str(image),
    ]  # fmt: skip
    mount = [_tool("mount"), "-t", "ext4", "-o", "loop,nosuid,nodev", str(image), str(path)]
    for argv in (mkfs, mount):
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            out = subprocess.CompletedProcess(argv, 1, "", str(e))
        if out.returncode != 0:
            image.unlink(missing_ok=True)
            raise MountError(
                f"cannot {Path(argv[0]).name} the session's disk image {image} for sandbox.disk_quota_mb: "
                f"{(out.stderr or out.stdout).strip()[:300]} (needs root, e2fsprogs and loop devices); "
                'set sandbox.disk_quota_backend = "tmpfs" (the quota in memory) or sandbox.disk_quota_mb = 0'
            )
    os.rmdir(path / "lost+found")  # mkfs's; the session starts empty
    os.chmod(path, 0o700)


def mount_quota(
    backend: QuotaBackend, path: Path, image: Path, size_bytes: int, inodes: int, uid: int
) -> None:
    if backend == "disk":
        mount_disk_image(path, image, size_bytes, inodes, uid)
    else:
        mount_tmpfs(path, size_bytes, inodes, uid)


def unmount(path: Path) -> None:
    """Detach a mount (lazily: processes still inside keep their view until they exit)."""
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more), or gone
            raise OSError(e, f"umount {path}: {os.strerror(e)}")


def mounts_under(root: Path) -> list[Path]:
    """Mount points strictly under `root` (from /proc/self/mountinfo), deepest first."""
    return [mp for mp, _fs in mounts_with_types(root)]


def mounts_with_types(root: Path) -> list[tuple[Path, str]]:
    """(mount point, filesystem type) strictly under `root`, deepest first."""
    prefix = str(root.resolve()).rstrip("/") + "/"
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # field 5 is the mount point, with space, tab, newline and backslash octal-escaped;
            # the filesystem type follows the " - " separator
            head, _, tail = line.partition(" - ")
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), head.split()[4])
            if mp.startswith(prefix):
                out.append((Path(mp), tail.split()[0]))
    return sorted(out, key=lambda p: len(p[0].parts), reverse=True)
