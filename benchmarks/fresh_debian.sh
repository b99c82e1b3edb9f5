#!/usr/bin/env bash
# The README's two commands on a bare Debian: debootstrap's minimal Debian 12 (bookworm) into a
# directory, this checkout cloned in (its current branch; and ../shared, or $SHARED, when there is one
# copied), then inside it, as root: `apt-get install make git` (what a user needs to clone the project
# and run the commands), `make setup`
# (which installs the Debian packages it lacks, tools/setup_env.sh), `make demo` and `make test`,
# each timed. Debian's mirror is the one this machine's apt uses; pip reaches the same index as
# here (pip's settings and CA certificates are copied in), with an empty cache. Needs root.
#   usage: benchmarks/fresh_debian.sh [DIR]   (default /var/tmp/dlrm-fresh-debian; removed at
#          the end unless KEEP=1; the timings are printed and written to DIR.log)
set -euo pipefail
ROOT=$(realpath -m "${1:-/var/tmp/dlrm-fresh-debian}")
LOG=$ROOT.log
REPO=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$REPO/../shared}   # the shared benchmark files some tests read
SUITE=bookworm
[ "$(id -u)" = 0 ] || { echo "error: run as root (debootstrap and chroot need it)" >&2; exit 2; }
[ ! -e "$ROOT" ] || { echo "error: $ROOT exists: remove it or name another directory" >&2; exit 2; }
command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }

# This machine's Debian mirrors (deb822 .sources or one-line .list files), else Debian's own.
uris() { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
  grep -oE "https?://[^ ]*/$1/?( |$)" | head -1 | tr -d ' ' || true; }
MIRROR=$(uris debian); MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=$(uris debian-security); SECURITY=${SECURITY:-http://deb.debian.org/debian-security}

cleanup() {
  for m in dev/pts dev/shm dev sys proc; do
    if mountpoint -q "$ROOT/$m"; then umount -l "$ROOT/$m"; fi
  done
  if grep -q " $ROOT/" /proc/mounts; then echo "error: left $ROOT: something is still mounted in it" >&2
  elif [ -z "${KEEP:-}" ]; then rm -rf "$ROOT"; fi
}
trap cleanup EXIT

start=$SECONDS
debootstrap --variant=minbase "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 ||
  { tail -5 "$ROOT.debootstrap.log" >&2; exit 1; }
echo "debootstrap --variant=minbase $SUITE: $((SECONDS - start)) s" | tee "$LOG"
printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
  "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" "$SECURITY" "$SUITE" >"$ROOT/etc/apt/sources.list"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$(hostname)" >"$ROOT/etc/hosts"
# This machine's CA certificates (a proxy's too): the bundle for pip, the extra ones for
# ca-certificates to add when a package pulls it in; and pip's settings, less local wheel folders.
cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/host-ca-certificates.crt"
mkdir -p "$ROOT/usr/local/share/ca-certificates"
cp -L /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/" 2>/dev/null || true
ENV=(HOME=/root LANG=C.UTF-8 TERM=dumb PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
     DEBIAN_FRONTEND=noninteractive PIP_CERT=/etc/host-ca-certificates.crt)
while IFS= read -r var; do
  case $var in PIP_CERT=*|PIP_FIND_LINKS=*|PIP_CONFIG_FILE=*|PIP_CONSTRAINT=*) ;; PIP_*) ENV+=("$var") ;; esac
done < <(env)

git clone -q --no-local "$REPO" "$ROOT/root/dlrm"
if [ -d "$SHARED" ]; then cp -r "$SHARED" "$ROOT/root/shared"; fi
mount -t proc proc "$ROOT/proc"
mount --bind /sys "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
if mountpoint -q /dev/pts; then mount --bind /dev/pts "$ROOT/dev/pts"; fi
if mountpoint -q /dev/shm; then mount --bind /dev/shm "$ROOT/dev/shm"; fi

# Runs a command line inside the Debian root, in the checkout, and logs how long it took.
timed() {
  local t=$SECONDS
  chroot "$ROOT" /usr/bin/env -i "${ENV[@]}" bash -c "cd /root/dlrm && $1" >>"$ROOT.run.log" 2>&1 ||
    { echo "error: '$1' failed in the Debian root after $((SECONDS - t)) s:" >&2; tail -30 "$ROOT.run.log" >&2; exit 1; }
  echo "$1: $((SECONDS - t)) s" | tee -a "$LOG"
}
timed "apt-get update -qq && apt-get install -y -qq make git"
timed "make setup"
timed "make demo"
timed "nice make test"
tail -1 "$ROOT.run.log" | tee -a "$LOG"
echo "$(date -u +%F) $(nproc) cores: $(tr '\n' ';' <"$LOG")"
