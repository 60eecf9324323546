#!/usr/bin/env bash
# Fetches, here, what PD needs on the device machine, whose image has Python 3.12 and torch but no
# Mooncake and none of the system libraries it links against (scripts/gpu_suite.sh, sections pd_gpu
# and pd_gpu_ttft, installs them from these folders; carry both, with .whl, into the device call):
#   .whl-pd/   Mooncake's transfer engine as a cp312 wheel, slimmed to what `mooncake.engine` loads
#              (the full wheel is 46 MB, mostly a benchmark binary and the store, over what a call carries)
#   .debs-pd/  the Debian packages of every shared library those files need beyond glibc and libstdc++
#              (found with ldd here: libibverbs, libnl-3, libnl-route-3, libnuma, libcurl and its
#              dependencies); gpu_suite.sh links in only the ones the device image lacks
# Usage: scripts/pd_device_deps.sh   (needs pip and apt-get with network access; no root needed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PKG=mooncake-transfer-engine-non-cuda==0.3.13.post1
WHL=.whl-pd
DEBS=.debs-pd
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$WHL" "$DEBS"
mkdir -p "$WHL" "$DEBS" "$work/full" "$work/slim"

# The wheel has one Linux build for CPython 3.12: manylinux_2_28_x86_64.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$work" "$PKG"
wheel=$(ls "$work"/*.whl)
(cd "$work/full" && unzip -q "$wheel")

# What `from mooncake.engine import TransferEngine` loads: the package's __init__ (its buffer_pool
# import of mooncake.store is optional), engine.so and the libraries its RPATH finds beside it.
keep=(mooncake/__init__.py mooncake/buffer_pool.py mooncake/engine.so mooncake/libasio.so mooncake/libetcd_wrapper.so)
for lib in glog gflags yaml-cpp jsoncpp; do
    keep+=("$(cd "$work/full" && ls mooncake_transfer_engine_non_cuda.libs/lib$lib-*)")
done
keep+=("$(cd "$work/full" && ls -d ./*.dist-info | sed 's|^\./||')")
(cd "$work/full" && cp -a --parents "${keep[@]}" "$work/slim/")
"$PY" - "$work/slim" "$WHL/$(basename "$wheel")" <<'PYEOF'
"""Zip the slimmed tree back into a wheel whose RECORD lists exactly its files (pip checks it)."""
import base64, hashlib, sys, zipfile
from pathlib import Path

root, out = Path(sys.argv[1]), Path(sys.argv[2])
record = next(root.glob("*.dist-info")) / "RECORD"
files = sorted(p for p in root.rglob("*") if p.is_file() and p != record)
lines = []
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
    for path in files:
        data = path.read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        name = path.relative_to(root).as_posix()
        lines.append(f"{name},sha256={digest},{len(data)}")
        info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
        info.external_attr = (path.stat().st_mode & 0xFFFF) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zf.writestr(info, data)
    lines.append(f"{record.relative_to(root).as_posix()},,")
    zf.writestr(record.relative_to(root).as_posix(), "\n".join(lines) + "\n")
PYEOF

# The Debian packages of the shared libraries the kept files need (ldd resolves them here), without
# the C runtime every Python image has (and must not be replaced).
sos=$(find "$work/slim" -name '*.so*' -type f -exec ldd {} + | awk '/=> \//{print $3}' | sort -u)
pkgs=$(for so in $sos; do
    real=$(readlink -f "$so")
    for path in "$so" "$real" "${real#/usr}" "/usr$real"; do dpkg -S "$path" 2>/dev/null && break; done
done | cut -d: -f1 | sort -u | grep -v -x -e libc6 -e libstdc++6 -e libgcc-s1 || true)
# librdmacm: what the Makefile installs with libibverbs (RDMA connection setup, loaded where a NIC is).
(cd "$DEBS" && apt-get download -q librdmacm1 $pkgs 2>&1) | grep -v "^W: Download is performed unsandboxed" || true
for pkg in librdmacm1 $pkgs; do  # every one, or a device run would fail on a missing library
    ls "$DEBS/${pkg}_"*.deb >/dev/null 2>&1 || { echo "pd_device_deps: $pkg was not downloaded (apt-get update?)" >&2; exit 1; }
done
du -sh "$WHL" "$DEBS"
