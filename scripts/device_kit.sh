#!/usr/bin/env bash
# Prepares, on a fresh CPU machine, what a device session carries to the GPU machine (which has
# nvcc, ninja and PyTorch but no network and no GoogleTest), all in ignored paths:
#   .gtest/                   this machine's GoogleTest headers and static archives (GTEST_ROOT there)
#   build-kit/cutlass.tar.xz  the pinned CUTLASS headers (scripts/setup_deps.sh), for device_job.sh
#   build-prebuilt/           with PREBUILD=1: a kernel set built here (scripts/prebuild.sh, the bench
#                             set by default: about 12 minutes on 2 cores), so the device builds nothing;
#                             carried packed as build-kit/prebuilt.tar.xz (the library's 55 MB of
#                             cubins pack to 5), which leaves room in the carry for the peers' parts
# and prints the carry list and the job's command. Start it first thing in a session and go on with
# other work: the GPU may come before the build is done (then carry the kit and build there).
#   scripts/device_kit.sh               # .gtest and the tarball (seconds)
#   PREBUILD=1 scripts/device_kit.sh    # and the prebuilt bench set (KERNELS=... for another set)
#   PREBUILD=1 VARIANTS="bench/ab_variants_pending.sh [NAME...]" scripts/device_kit.sh
#                                       # and the variants that queue lists (all, or those named), for
#                                       # device_job.sh's AB_VARIANTS (about 5 MB each: the carry holds ten)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/setup_deps.sh >/dev/null
gtest_headers=/usr/include/gtest
[ -f "$gtest_headers/gtest.h" ] || { echo "device_kit: no $gtest_headers (Debian: libgtest-dev)" >&2; exit 1; }
rm -rf .gtest && mkdir -p .gtest/include .gtest/lib
cp -r "$gtest_headers" .gtest/include/
[ -d /usr/include/gmock ] && cp -r /usr/include/gmock .gtest/include/
libs=$(ls /usr/lib/*/libgtest*.a /usr/lib/*/libgmock*.a /usr/lib/libgtest*.a 2>/dev/null || true)
[ -n "$libs" ] || { echo "device_kit: no libgtest*.a found under /usr/lib" >&2; exit 1; }
# shellcheck disable=SC2086
cp $libs .gtest/lib/
mkdir -p build-kit && rm -f build-kit/prebuilt.tar.xz
tar cJf build-kit/cutlass.tar.xz -C third_party cutlass/include cutlass/tools
carry='".gtest", "build-kit"' folders=".gtest build-kit"
if [ "${PREBUILD:-0}" = 1 ]; then
  scripts/prebuild.sh "${KERNELS:-bench}" build-prebuilt
  tar cJf build-kit/prebuilt.tar.xz build-prebuilt
  job="CUTLASS_TARBALL=build-kit/cutlass.tar.xz PREBUILT=build-kit/prebuilt.tar.xz"
  if [ -n "${VARIANTS:-}" ]; then  # the queue's variants against it (1.5-5 min each)
    rm -f build-kit/variant_*.tar.xz
    # shellcheck disable=SC2086
    scripts/prebuild_variant.sh --queue $VARIANTS  # QUEUE [NAME...]
    job="$job AB_VARIANTS=${VARIANTS%% *}"
  fi
else
  job="CUTLASS_TARBALL=build-kit/cutlass.tar.xz KERNELS=${KERNELS:-bench}"
fi
# shellcheck disable=SC2086
echo "device kit ready ($(du -sm $folders | awk '{s += $1} END {print s}') MB of the device tool's 64 MiB):"
echo "  carry: [$carry]"
echo "  start: rm -rf /tmp/fhjob && (setsid nohup bash -c '$job STEPS=\"gate tests python\"" \
     "scripts/device_job.sh > /tmp/job.log 2>&1' > /dev/null 2>&1 < /dev/null &)"
echo "  then, within 30 s of each call's end: cat /tmp/fhjob/out/progress.log (until ALL DONE)"
