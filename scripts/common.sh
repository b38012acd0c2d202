# Helpers sourced by the setup scripts (bash). The sourcing script defines log().

# A boolean setting, read as hipress.config reads booleans (the package cannot be imported
# before it is built): 1/true/yes/on or 0/false/no/off in any case; unset or empty = DEFAULT.
is_on() {  # is_on NAME DEFAULT
  local v
  read -r v <<< "${!1:-}"  # trims surrounding blanks
  case "${v:-$2}" in
    [Tt][Rr][Uu][Ee] | [Yy][Ee][Ss] | [Oo][Nn] | 1) return 0 ;;
    [Ff][Aa][Ll][Ss][Ee] | [Nn][Oo] | [Oo][Ff][Ff] | 0) return 1 ;;
    *) printf '%s=%s: expected one of 1, true, yes, on, 0, false, no, off\n' "$1" "$v" >&2; exit 2 ;;
  esac
}

# apt_install_missing CMD:PKG[,PKG...] ...
#   apt-get installs the packages listed for every CMD that is not on PATH, in one
#   apt-get call (sudo unless root). Does nothing with HIPRESS_SKIP_APT on or without apt-get.
apt_install_missing() {
  if is_on HIPRESS_SKIP_APT 0 || ! command -v apt-get >/dev/null; then
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
