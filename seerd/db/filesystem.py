"""Which filesystem holds a path, and whether other hosts share it: read from /proc/self/mountinfo.

Why it matters (docs/shared-filesystems.md): SQLite's WAL index is the `-shm` file, mapped into
memory by every connection. Processes of one host see one page cache, so their maps agree; a
process on another host maps its own copy over a network filesystem, which nothing keeps coherent
with ours. `seerd.db.sharing` decides what to allow from this module's verdict.

The verdict is `network`, `local` or `unknown` (no readable mountinfo, no mount holding the path:
treated as local, since nothing here may stop a run on a guess). FUSE mounts count as network
except the few that only ever serve this host (rootless containers' fuse-overlayfs, lxcfs, ...):
most FUSE filesystems on a cluster are remote (sshfs, gcsfuse, JuiceFS, ceph-fuse).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")  # read at each call, so that a test can point it elsewhere

# Filesystems whose files other hosts open too. SQLite's docs: WAL "does not work over a network
# filesystem"; a shared-disk cluster filesystem (GFS2, OCFS2) is the same case for the -shm map.
NETWORK_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "9p", "afs", "glusterfs", "beegfs",
    "pvfs2", "orangefs", "panfs", "wekafs", "gfs2", "ocfs2", "davfs", "virtiofs", "vboxsf", "ncpfs",
})
# FUSE subtypes that serve only this host (the rest of fuse.* counts as network).
LOCAL_FUSE_SUBTYPES = frozenset({
    "fuse-overlayfs", "lxcfs", "squashfuse", "squashfuse_ll", "portal", "gvfsd-fuse", "bindfs", "ntfs-3g",
    "appimagekit", "snapfuse", "encfs", "gocryptfs",
})
LOCAL_BLOCK_FUSE = frozenset({"fuseblk"})  # a FUSE driver of a local block device (ntfs-3g, exfat)

# Mount options that change what SQLite's fcntl locks do across hosts, and what they do.
_LOCKS_STAY_LOCAL = "fcntl locks stay on each host, never reaching the server"
_LOCK_OPTIONS = {
    "nolock": _LOCKS_STAY_LOCAL,  # NFS (v2/v3; it implies local_lock=all)
    "local_lock=all": _LOCKS_STAY_LOCAL,  # NFS
    "local_lock=posix": _LOCKS_STAY_LOCAL,  # NFS
    "localflock": _LOCKS_STAY_LOCAL,  # Lustre
    "nobrl": _LOCKS_STAY_LOCAL,  # CIFS: byte-range locks are not sent to the server
    "noflock": "fcntl locks are refused (SQLite cannot lock the database at all)",  # Lustre
}


@dataclass(frozen=True)
class Filesystem:
    """The mount that holds a path."""

    kind: str  # "network", "local" or "unknown"
    fs_type: str  # as mountinfo says: "nfs4", "lustre", "fuse.sshfs", ...; "" when unknown
    mount_point: str
    source: str  # "server:/export", "/dev/sda1", ...
    options: frozenset[str]  # the mount's options and the filesystem's own, together
    why_unknown: str = ""

    @property
    def network(self) -> bool:
        return self.kind == "network"

    @property
    def lock_caveat(self) -> str | None:
        """What the mount's options do to SQLite's locks across hosts ("`nolock`, `local_lock=all`:
        fcntl locks stay on each host, ..."), or None when they leave them alone."""
        by_effect: dict[str, list[str]] = {}
        for option, effect in _LOCK_OPTIONS.items():
            if option in self.options:
                by_effect.setdefault(effect, []).append(f"`{option}`")
        return "; ".join(f"{', '.join(options)}: {effect}" for effect, options in by_effect.items()) or None

    def describe(self) -> str:
        if self.kind == "unknown":
            return f"an unknown filesystem ({self.why_unknown})"
        return f"{self.fs_type} {self.source} mounted at {self.mount_point}"


@dataclass(frozen=True)
class Mount:
    mount_point: str
    root: str  # the part of the filesystem mounted there (a bind mount's subdirectory)
    fs_type: str
    source: str
    options: frozenset[str]


def filesystem_of(path: Path | str, mountinfo: Path | None = None) -> Filesystem:
    """The filesystem holding `path`, resolved (symlinks followed as far as it exists). Never
    raises: an unreadable mountinfo, or one with no mount holding the path, gives kind "unknown"."""
    source = MOUNTINFO if mountinfo is None else Path(mountinfo)
    try:
        mounts = parse_mountinfo(source.read_text(errors="replace"))
    except OSError as exc:
        return _unknown(f"cannot read {source}: {exc.strerror or exc}")
    mount = mount_holding(os.path.realpath(path), mounts)
    if mount is None:
        return _unknown(f"no mount in {source} holds {path}")
    return Filesystem(classify(mount.fs_type), mount.fs_type, mount.mount_point, mount.source, mount.options)


def classify(fs_type: str) -> str:
    """"network" or "local" for a mountinfo filesystem type."""
    base, _, subtype = fs_type.partition(".")
    if base in NETWORK_TYPES:
        return "network"
    if base in LOCAL_BLOCK_FUSE or (base == "fuse" and subtype in LOCAL_FUSE_SUBTYPES):
        return "local"
    if base == "fuse":  # sshfs, glusterfs, s3fs, gcsfuse, juicefs, ceph-fuse, a bare "fuse"
        return "network"
    return "local"


def mount_holding(resolved: str, mounts: list[Mount]) -> Mount | None:
    """The mount whose mount point is the longest prefix of `resolved` (an absolute path without
    symlinks), by whole components; of mounts on the same point, the last (it hides the others)."""
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point
        inside = resolved == point or point == "/" or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = mount
    return best


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo file (proc(5)), in its order; lines that do not parse are skipped.

    `36 35 98:0 /root /mnt rw,noatime master:1 - ext3 /dev/root rw,errors=continue`: mount id,
    parent id, device, root, mount point, mount options, optional fields up to `-`, type, source,
    superblock options. Spaces, tabs, newlines and backslashes in names are octal escapes (`\\040`).
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
            root, mount_point, mount_options = fields[3], fields[4], fields[5]
            fs_type, source = fields[separator + 1], fields[separator + 2]
            super_options = fields[separator + 3] if len(fields) > separator + 3 else ""
        except (ValueError, IndexError):
            continue
        options = frozenset(option for option in f"{mount_options},{super_options}".split(",") if option)
        mounts.append(Mount(_unescape(mount_point), _unescape(root), fs_type, _unescape(source), options))
    return mounts


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def _unknown(why: str) -> Filesystem:
    return Filesystem("unknown", "", "", "", frozenset(), why)
