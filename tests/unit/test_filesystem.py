"""Which filesystem holds a path (seerd/db/filesystem.py), from mountinfo lines as real hosts write
them: a cluster node (NFS home, Lustre scratch, GPFS projects, a CIFS share, sshfs, a node-local
disk inside the Lustre tree), a Docker container (overlay root) and a rootless one (fuse-overlayfs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from seerd.db.filesystem import classify, filesystem_of, parse_mountinfo

CLUSTER_NODE = """\
21 26 0:20 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
22 26 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:14 - proc proc rw
26 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro
27 22 0:25 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,inode64
30 26 0:27 / /tmp rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=65536000k,inode64
95 26 0:48 / /home rw,relatime shared:50 - nfs4 nas01:/export/home rw,vers=4.2,rsize=1048576,wsize=1048576,\
namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.1.2.3,local_lock=none,addr=10.1.0.5
96 26 0:49 / /scratch rw,relatime shared:51 - lustre 10.0.0.1@o2ib:10.0.0.2@o2ib:/scratch rw,flock,lazystatfs,\
encrypt
97 96 259:3 / /scratch/node-local rw,relatime shared:52 - xfs /dev/nvme1n1 rw,attr2,inode64,logbufs=8,noquota
98 26 0:50 / /gpfs/projects rw,relatime shared:53 - gpfs projects rw
99 26 0:51 / /mnt/share rw,relatime shared:54 - cifs //fileserver/share rw,vers=3.1.1,cache=strict,username=alice,\
uid=1000,noforceuid,gid=1000,noforcegid,addr=10.0.0.9,file_mode=0755,dir_mode=0755,soft,nounix,serverino,mapposix,\
nobrl,rsize=4194304,wsize=4194304,bsize=1048576,echo_interval=60,actimeo=1
100 95 0:52 / /home/alice/remote rw,nosuid,nodev,relatime shared:55 - fuse.sshfs alice@login01:/data \
rw,user_id=1000,group_id=1000
101 26 0:53 / /mnt/old\\040runs rw,relatime shared:56 - nfs filer:/vol/old\\040runs rw,vers=3,rsize=65536,\
wsize=65536,namlen=255,hard,nolock,proto=tcp,timeo=600,retrans=2,sec=sys,mountaddr=10.0.0.7,mountvers=3,\
mountport=635,mountproto=tcp,local_lock=all,addr=10.0.0.7
102 26 0:54 / /lustre/fast rw,relatime shared:57 - lustre 10.0.0.3@tcp:/fast rw,localflock,lazystatfs
103 26 0:55 / /mnt/gluster rw,relatime shared:58 - fuse.glusterfs gl01:/vol rw,user_id=0,group_id=0,\
default_permissions,allow_other,max_read=131072
104 26 0:56 / /mnt/beegfs rw,relatime shared:59 - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf
105 26 0:57 / /var/lib/lxcfs rw,nosuid,nodev,relatime shared:60 - fuse.lxcfs lxcfs rw,user_id=0,group_id=0
"""

# Inside a Docker container: the root is an overlay, the run directory a bind mount of an NFS export.
CONTAINER = """\
500 400 0:60 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/ABC:\
/var/lib/docker/overlay2/l/DEF,upperdir=/var/lib/docker/overlay2/123/diff,workdir=/var/lib/docker/overlay2/123/work
501 500 0:61 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
502 500 0:62 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755,inode64
503 500 0:48 /export/runs/r1 /runs rw,relatime - nfs4 nas01:/export rw,vers=4.1,local_lock=none,addr=10.1.0.5
"""

# A rootless container (podman): the root is fuse-overlayfs, which serves this host only.
ROOTLESS = """\
600 590 0:70 / / rw,nodev,relatime - fuse.fuse-overlayfs fuse-overlayfs rw,user_id=0,group_id=0,\
default_permissions,allow_other
"""


def mountinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("path", "kind", "fs_type", "mount_point"), [
    ("/home/alice/runs/r1/state.db", "network", "nfs4", "/home"),
    ("/scratch/alice/r1/state.db", "network", "lustre", "/scratch"),
    ("/scratch/node-local/r1/state.db", "local", "xfs", "/scratch/node-local"),  # nested: the inner mount
    ("/scratch/node-local-not/r1/state.db", "network", "lustre", "/scratch"),  # a prefix by name only
    ("/gpfs/projects/p1/state.db", "network", "gpfs", "/gpfs/projects"),
    ("/mnt/share/r1/state.db", "network", "cifs", "/mnt/share"),
    ("/home/alice/remote/r1/state.db", "network", "fuse.sshfs", "/home/alice/remote"),  # inside /home
    ("/mnt/gluster/r1/state.db", "network", "fuse.glusterfs", "/mnt/gluster"),
    ("/mnt/beegfs/r1/state.db", "network", "beegfs", "/mnt/beegfs"),
    ("/var/lib/lxcfs/proc", "local", "fuse.lxcfs", "/var/lib/lxcfs"),
    ("/tmp/r1/state.db", "local", "tmpfs", "/tmp"),
    ("/dev/shm/r1/state.db", "local", "tmpfs", "/dev/shm"),
    ("/opt/runs/r1/state.db", "local", "ext4", "/"),
    ("/scratch", "network", "lustre", "/scratch"),  # the mount point itself
])
def test_a_cluster_nodes_mounts_say_which_filesystem_holds_a_path(tmp_path, path, kind, fs_type, mount_point):
    found = filesystem_of(path, mountinfo(tmp_path, CLUSTER_NODE))
    assert (found.kind, found.fs_type, found.mount_point) == (kind, fs_type, mount_point)


def test_escaped_spaces_in_mount_points_and_sources_are_read_as_spaces(tmp_path):
    found = filesystem_of("/mnt/old runs/r1/state.db", mountinfo(tmp_path, CLUSTER_NODE))
    assert (found.kind, found.mount_point, found.source) == ("network", "/mnt/old runs", "filer:/vol/old runs")
    assert filesystem_of("/mnt/old/r1", mountinfo(tmp_path, CLUSTER_NODE)).fs_type == "ext4"


def test_mount_options_that_keep_locks_on_one_host_are_named(tmp_path):
    info = mountinfo(tmp_path, CLUSTER_NODE)
    stays = "fcntl locks stay on each host, never reaching the server"
    assert filesystem_of("/mnt/old runs/x", info).lock_caveat == f"`nolock`, `local_lock=all`: {stays}"
    assert filesystem_of("/lustre/fast/x", info).lock_caveat == f"`localflock`: {stays}"
    assert filesystem_of("/mnt/share/x", info).lock_caveat == f"`nobrl`: {stays}"
    assert filesystem_of("/home/alice/x", info).lock_caveat is None  # local_lock=none: locks reach the server
    assert filesystem_of("/scratch/x", info).lock_caveat is None  # Lustre with flock
    noflock = "26 1 0:49 / / rw - lustre mds@tcp:/fs rw,noflock\n"
    assert "refused" in filesystem_of("/x", mountinfo(tmp_path, noflock)).lock_caveat


def test_a_container_root_is_local_and_its_nfs_bind_mount_is_network(tmp_path):
    info = mountinfo(tmp_path, CONTAINER)
    assert filesystem_of("/workspace/r1/state.db", info).kind == "local"  # overlay
    runs = filesystem_of("/runs/state.db", info)
    assert (runs.kind, runs.fs_type, runs.source) == ("network", "nfs4", "nas01:/export")
    assert filesystem_of("/", mountinfo(tmp_path, ROOTLESS)).kind == "local"  # fuse-overlayfs


def test_of_two_mounts_on_one_point_the_last_hides_the_first(tmp_path):
    # autofs holds /data until first use, then the NFS mount is stacked on the same point.
    text = ("40 26 0:40 / /data rw,relatime shared:30 - autofs systemd-1 rw,fd=50,pgrp=1,timeout=0\n"
            "41 40 0:41 / /data rw,relatime shared:31 - nfs4 nas:/data rw,vers=4.2,local_lock=none\n")
    text = "26 1 259:2 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n" + text
    assert filesystem_of("/data/r1/state.db", mountinfo(tmp_path, text)).fs_type == "nfs4"


def test_symlinks_are_resolved_before_the_mount_is_looked_up(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    text = (f"26 1 259:2 / / rw,relatime - ext4 /dev/sda1 rw\n"
            f"95 26 0:48 / {real} rw,relatime - nfs4 nas01:/export rw,vers=4.2\n")
    assert filesystem_of(tmp_path / "link" / "state.db", mountinfo(tmp_path, text)).kind == "network"


def test_an_unreadable_or_garbled_mountinfo_is_unknown_and_counts_as_local(tmp_path):
    missing = filesystem_of("/home/x", tmp_path / "no-such-mountinfo")
    assert missing.kind == "unknown" and not missing.network and "cannot read" in missing.describe()
    garbled = filesystem_of("/home/x", mountinfo(tmp_path, "not a mountinfo line\n\n1 2 3\n"))
    assert garbled.kind == "unknown" and not garbled.network
    assert parse_mountinfo("36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue")[0] \
        .options == frozenset({"rw", "noatime", "errors=continue"})


def test_this_hosts_own_mountinfo_parses_and_holds_the_root():
    found = filesystem_of("/")
    assert found.kind in ("local", "network") and found.mount_point == "/"


@pytest.mark.parametrize(("fs_type", "kind"), [
    ("nfs", "network"), ("nfs4", "network"), ("lustre", "network"), ("gpfs", "network"), ("cifs", "network"),
    ("smb3", "network"), ("ceph", "network"), ("9p", "network"), ("fuse.sshfs", "network"),
    ("fuse.juicefs", "network"), ("fuse", "network"), ("fuse.fuse-overlayfs", "local"), ("fuseblk", "local"),
    ("ext4", "local"), ("xfs", "local"), ("btrfs", "local"), ("zfs", "local"), ("overlay", "local"),
    ("tmpfs", "local"),
])
def test_filesystem_types_are_classified(fs_type, kind):
    assert classify(fs_type) == kind
