{{/* Names and labels shared by every manifest of the chart. */}}

{{- define "hsx.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name; a release called "hsx" is not doubled to "hsx-hsx". */}}
{{- define "hsx.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "hsx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hsx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "hsx.labels" -}}
{{ include "hsx.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "hsx.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "hsx.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: digest wins, then tag, then the chart's appVersion. */}}
{{- define "hsx.image" -}}
{{- $img := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default $root.Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{- define "hsx.peeringName" -}}
{{- default (include "hsx.fullname" .) .Values.peering.name -}}
{{- end -}}

{{/* The namespaces the operator watches, as JSON: watchNamespaces, else (namespaced RBAC, the default) the
release's own namespace, else [] for all namespaces (rbac.namespaced=false, a ClusterRole). */}}
{{- define "hsx.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else if .Values.rbac.namespaced -}}
{{- toJson (list .Release.Namespace) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* Combinations that would install something broken fail early, with a message that says why. */}}
{{- define "hsx.checkValues" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peering.enabled) -}}
{{- fail "replicaCount > 1 needs peering.enabled=true: two standalone operators would reconcile the same jobs" -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in a namespace it manages (docs/rbac.md says why each). */}}
{{- define "hsx.namespacedRules" -}}
# Watch runs; kopf patches metadata (finalizer, its annotations), the operator patches status.
- apiGroups: ["hsx.dev"]
  resources: ["extractionjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["hsx.dev"]
  resources: ["extractionjobs/status"]
  verbs: ["get", "patch"]
# One Job per run; delete stops a superseded run or a deleted ExtractionJob's run.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# One JobSet per run whose server spans nodes (server.nodes > 1); same verbs as for Jobs.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The extractor's config for each run.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create"]
# Read pod state and the events of pending pods to explain a stuck run.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# Kueue's Workload of a queued Job, to say Queued only when Kueue really holds it.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list"]
{{- if .Values.peering.enabled }}
# kopf peering: standby replicas learn which one is active.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}
