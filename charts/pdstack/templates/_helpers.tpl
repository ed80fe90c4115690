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

{{/* Labels on every object of the release (the operator's selector labels included). */}}
{{- define "pdstack.labels" -}}
{{ include "pdstack.releaseLabels" . }}
{{ include "pdstack.selectorLabels" . }}
{{- end }}

{{/* The release's labels without the operator's selector labels: for pods that are not the operator's (the
`helm test` pod, hook Jobs), which its Deployment, Service, ServiceMonitor and NetworkPolicy must not select. */}}
{{- define "pdstack.releaseLabels" -}}
helm.sh/chart: {{ include "pdstack.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdstack
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdstack.testLabels" -}}
{{ include "pdstack.releaseLabels" . }}
app.kubernetes.io/name: {{ include "pdstack.name" . }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: helm-test
{{- end }}

{{- define "pdstack.hookLabels" -}}
{{ include "pdstack.releaseLabels" . }}
app.kubernetes.io/name: {{ include "pdstack.name" . }}-hooks
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: hooks
{{- end }}

{{/* A hook Job: dict ctx (root), name, sa, events (helm.sh/hook), args (python -m pdoperator.hooks ...),
crdVolume (a ConfigMap mounted at /etc/pdstack/crds, optional). */}}
{{- define "pdstack.hookJob" -}}
{{- $ := .ctx }}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ .name | trunc 63 | trimSuffix "-" }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "pdstack.hookLabels" $ | nindent 4 }}
  annotations:
    helm.sh/hook: {{ .events }}
    helm.sh/hook-weight: "0"
    helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
spec:
  backoffLimit: 2
  activeDeadlineSeconds: {{ add $.Values.hooks.timeoutSeconds 120 }}
  template:
    metadata:
      labels:
        {{- include "pdstack.hookLabels" $ | nindent 8 }}
    spec:
      restartPolicy: Never
      serviceAccountName: {{ .sa }}
      {{- with $.Values.operator.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        runAsNonRoot: true
        runAsUser: {{ $.Values.operator.uid }}
        runAsGroup: {{ $.Values.operator.uid }}
        seccompProfile:
          type: RuntimeDefault
      containers:
        - name: hook
          image: {{ include "pdstack.operatorImage" $ | quote }}
          imagePullPolicy: {{ $.Values.operator.image.pullPolicy }}
          command: [python, -m, pdoperator.hooks]
          args:
            {{- toYaml .args | nindent 12 }}
          resources:
            requests: {cpu: 50m, memory: 64Mi}
            limits: {memory: 256Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            runAsNonRoot: true
            capabilities:
              drop: [ALL]
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            {{- if .crdVolume }}
            - {name: crds, mountPath: /etc/pdstack/crds, readOnly: true}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- if .crdVolume }}
        - name: crds
          configMap: {name: {{ .crdVolume }}}
        {{- end }}
      {{- with $.Values.operator.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $.Values.operator.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
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

{{/* Prometheus as a NetworkPolicyPeer: its namespaces, and its pods there when networkPolicy.prometheusPodSelector
is set. */}}
{{- define "pdstack.prometheusPeer" -}}
{{- $peer := dict "namespaceSelector" .Values.networkPolicy.prometheusNamespaceSelector }}
{{- with .Values.networkPolicy.prometheusPodSelector }}
{{- $_ := set $peer "podSelector" . }}
{{- end }}
{{- toYaml $peer }}
{{- end }}

{{/* The operator's pods as a NetworkPolicyPeer: the release namespace and the operator's selector labels, unless
networkPolicy.operatorNamespaceSelector / operatorPodSelector say otherwise. */}}
{{- define "pdstack.operatorPeer" -}}
{{- $ownNs := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) }}
{{- $ns := .Values.networkPolicy.operatorNamespaceSelector | default $ownNs }}
{{- $ownPods := dict "matchLabels" (include "pdstack.selectorLabels" . | fromYaml) }}
{{- $pods := .Values.networkPolicy.operatorPodSelector | default $ownPods }}
{{- toYaml (dict "namespaceSelector" $ns "podSelector" $pods) }}
{{- end }}

{{/* PDSTACK_OPERATOR_NETWORK_PEERS: who each PDDeployment's NetworkPolicy admits to the workers' http port
(/config, /metrics) besides the deployment's own pods: the operator, Prometheus, networkPolicy.extraWorkerPeers. */}}
{{- define "pdstack.networkPeers" -}}
{{- $operator := list (include "pdstack.operatorPeer" . | fromYaml) }}
{{- $prometheus := list (include "pdstack.prometheusPeer" . | fromYaml) }}
{{- $prometheus = concat $prometheus .Values.networkPolicy.extraWorkerPeers }}
{{- dict "operator" $operator "prometheus" $prometheus | toJson }}
{{- end }}

{{/* "true" when the Prometheus Operator's objects may be rendered: the cluster serves monitoring.coreos.com/v1
(helm install/upgrade see the cluster; helm template: --api-versions monitoring.coreos.com/v1), or
monitoring.crds is "always" (GitOps tools that render without a cluster). */}}
{{- define "pdstack.monitoringAPI" -}}
{{- $served := .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}
{{- if or (eq .Values.monitoring.crds "always") $served }}true{{ end }}
{{- end }}
