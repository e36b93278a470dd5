//go:build tools

// Package jobset only pins the command that build.sh compiles (JobSet's manager is its module's root package).
package jobset

import (
	_ "sigs.k8s.io/jobset"
)
