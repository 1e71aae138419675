#!/bin/sh
# Run a command cut off from everything outside its own process tree: in a network
# namespace of its own (nothing but its loopback, up: servers a test starts itself are
# reached, the machine's PostgreSQL and Redis and the network are not) and with HOME an
# empty folder (no cached model). `make test-unit` runs the unit tests so, and a unit test
# that reaches for a service, the bundled model or the network fails. Where no namespace
# can be made (no `unshare` or `ip`, no privilege), the command runs as it is, and says so.
set -u
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
if command -v ip >/dev/null 2>&1 && unshare --net --map-root-user ip link set lo up 2>/dev/null; then
  HOME="$home" unshare --net --map-root-user sh -c 'ip link set lo up && "$@"' offline "$@"
else
  echo "offline.sh: no network namespace here; running with the network" >&2
  HOME="$home" "$@"
fi
