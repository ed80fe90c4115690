{{/* Name helpers, following `helm create` conventions. */}}
{{- define "pdstack.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdstack.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdstack.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "pdstack.labels" -}}
helm.sh/chart: {{ include "pdstack.chart" . }}
{{ include "pdstack.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdstack
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The operator pod's selector labels. */}}
{{- define "pdstack.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdstack.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdstack.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdstack.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Watched namespaces: the list, or the release namespace. */}}
{{- define "pdstack.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces }}
{{- toYaml (uniq .Values.operator.watchNamespaces) }}
{{- else }}
{{- toYaml (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{- define "pdstack.operatorImage" -}}
{{- $img := .Values.operator.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{- define "pdstack.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtime.image.repository (default .Chart.AppVersion .Values.runtime.image.tag) }}
{{- end }}

{{/* Selector of every pod the operator runs (workers and routers of every PDDeployment). */}}
{{- define "pdstack.runtimePodSelector" -}}
matchLabels:
  app.kubernetes.io/name: pdstack
matchExpressions:
  - {key: pdstack.io/component, operator: In, values: [worker, router]}
{{- end }}

{{/* namespaceSelector for monitors: the watched namespaces, or any in cluster-wide mode. */}}
{{- define "pdstack.monitorNamespaceSelector" -}}
{{- if .Values.operator.clusterWide }}
any: true
{{- else }}
matchNames:
{{- include "pdstack.watchNamespaces" . | nindent 2 }}
{{- end }}
{{- end }}
