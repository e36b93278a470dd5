//go:build tools

// Package helm only pins the command that build.sh compiles.
package helm

import _ "helm.sh/helm/v4/cmd/helm"
