#!/usr/bin/env python3
"""Run a command while leading a kazoo `Election` (for `baton bench handoff --kazoo`).

    kazoo-election.py HOSTS PATH ID SESSION_TIMEOUT_SECONDS -- CMD [ARGS...]

kazoo's recipe: the contender creates an ephemeral sequential lock node under PATH and watches
its predecessor; `Election.run` calls the function once it holds the lock and releases the lock
(deletes its node) when the function returns. Here the function runs CMD and waits for it, so
the lock passes on when CMD exits, as with `etcdctl lock`. kazoo itself is installed with
`pip install kazoo` (scripts/bench does it).
"""
import subprocess
import sys

from kazoo.client import KazooClient


def main() -> int:
    if len(sys.argv) < 7 or sys.argv[5] != "--":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    hosts, path, identifier, timeout = sys.argv[1:5]
    command = sys.argv[6:]
    # kazoo creates paths inside a chroot, never the chroot itself: make it first, as baton's
    # own first campaign would.
    servers, slash, chroot = hosts.partition("/")
    if slash and chroot:
        root = KazooClient(hosts=servers, timeout=float(timeout))
        root.start()
        try:
            root.ensure_path("/" + chroot)
        finally:
            root.stop()
            root.close()
    client = KazooClient(hosts=hosts, timeout=float(timeout))
    client.start()
    try:
        election = client.Election(path, identifier)
        election.run(lambda: subprocess.run(command).returncode)
    finally:
        client.stop()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
