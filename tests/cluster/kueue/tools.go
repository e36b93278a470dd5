//go:build tools

// Package kueue only pins the command that build.sh compiles.
package kueue

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
