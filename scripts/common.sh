# Helpers sourced by the setup scripts (bash). The sourcing script defines log().

# apt_install_missing CMD:PKG[,PKG...] ...
#   apt-get installs the packages listed for every CMD that is not on PATH, in one
#   apt-get call (sudo unless root). Does nothing with HIPRESS_SKIP_APT=1 or without apt-get.
apt_install_missing() {
  if [ "${HIPRESS_SKIP_APT:-0}" = 1 ] || ! command -v apt-get >/dev/null; then
    return 0
  fi
  local need=() spec pkgs
  for spec in "$@"; do
    if ! command -v "${spec%%:*}" >/dev/null; then
      IFS=, read -ra pkgs <<< "${spec#*:}"
      need+=("${pkgs[@]}")
    fi
  done
  if [ ${#need[@]} -gt 0 ]; then
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    log "installing system packages: ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
}
