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

{{/* Namespace-scoped RBAC needs the list of namespaces; fail early with a message that says so. */}}
{{- define "hsx.checkScope" -}}
{{- if and .Values.rbac.namespaced (empty .Values.watchNamespaces) -}}
{{- fail "rbac.namespaced=true needs watchNamespaces: list the namespaces the operator may manage" -}}
{{- end -}}
{{- end -}}

{{/*
The rules the operator needs inside a namespace it manages (docs/rbac.md explains each).
*/}}
{{- define "hsx.namespacedRules" -}}
- apiGroups: ["hsx.dev"]
  resources: ["extractionjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["hsx.dev"]
  resources: ["extractionjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
