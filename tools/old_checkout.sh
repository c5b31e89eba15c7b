# Sourced by the results' run.sh scripts that time an older commit against this checkout:
# `old_checkout COMMIT DIR` puts COMMIT in a worktree at DIR (once) with a cache folder of its
# own that links everything of the user's cache but the compiled kernels (the old commit builds
# its own csrc; the converted model is shared); `in_old CMD...` runs CMD there, on that commit's
# package and cache.
old_checkout() {
  OLD=$2
  [ -d "$OLD" ] || git worktree add -q --detach "$OLD" "$1"
  local cache=${CONSTRAINED_SPEC_CACHE:-$HOME/.cache/constrained_spec} entry
  mkdir -p "$OLD/.cache"
  for entry in "$cache"/*; do
    [ "$(basename "$entry")" = kernels ] || ln -sfn "$entry" "$OLD/.cache/$(basename "$entry")"
  done
}

in_old() {
  (cd "$OLD" && env CONSTRAINED_SPEC_CACHE="$OLD/.cache" PYTHONPATH="$OLD" "$@")
}
