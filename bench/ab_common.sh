# shellcheck shell=bash
# What the one-build A/B script (ab_source_line.sh) keeps apart, sourced by it after it sets
# $build (the job's build folder), $out (its output folder) and log().

# Rewrites the first occurrence of FROM in FILE to TO; fails (and says so) where FROM is not there.
rewrite() {
  local file=$1 from=$2 to=$3
  grep -qF -- "$from" "$file" || { log "no line '$from' in $file"; return 1; }
  python3 - "$file" "$from" "$to" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
open(path, "w").write(text.replace(old, new, 1))
PY
}

# Recompiles the given objects of $build in parallel with the commands ninja has for them (so no
# header-driven rebuild of the rest), then relinks libflashhopper.so; logs under $out by NAME.
rebuild_library() {
  local name=$1 o p ok=1 pids=()
  shift
  for o in "$@"; do
    (cd "$build" && eval "$(ninja -t commands "$o" | tail -1)") > "$out/compile_${name}_$(basename "$o").log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  [ $ok = 1 ] || { log "$name: a compile failed (compile_${name}_*.log)"; return 1; }
  (cd "$build" && eval "$(ninja -t commands libflashhopper.so.0.1.0 | tail -1)") > "$out/link_$name.log" 2>&1 ||
    { log "$name: the link failed (link_$name.log)"; return 1; }
}
