{{/* Names: <release> when it already contains the chart name, else <release>-<chart>. */}}
{{- define "megapod.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "megapod.fullname" -}}
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

{{- define "megapod.llmName" -}}{{ include "megapod.fullname" . | trunc 59 }}-llm{{- end }}
{{- define "megapod.snacName" -}}{{ include "megapod.fullname" . | trunc 58 }}-snac{{- end }}

{{- define "megapod.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "megapod.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "megapod.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "megapod.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: orpheus-megapod
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector of one tier: call with (dict "ctx" $ "component" "llm"). */}}
{{- define "megapod.selectorLabels" -}}
app.kubernetes.io/name: {{ include "megapod.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
A server config map (camelCase field -> value) as environment variables PREFIX_FIELD: the
servers read each field of their config dataclass from exactly that variable. Whole floats print
as integers, so 1000000 never becomes 1e+06.
Call with (dict "prefix" "SNAC_" "server" .Values.snac.server).
*/}}
{{- define "megapod.serverEnv" -}}
{{- $server := .server }}
{{- range $key := keys $server | sortAlpha }}
{{- $value := get $server $key }}
- name: {{ printf "%s%s" $.prefix (snakecase $key | upper) }}
{{- if kindIs "slice" $value }}
  value: {{ join "," $value | quote }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
  value: {{ int64 $value | toString | quote }}
{{- else }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Requests/limits plus the tier's accelerator (a GPU, a MIG instance, or none). Quantities
are strings: the kubernetes Python client's models refuse numbers there. */}}
{{- define "megapod.resources" -}}
{{- $limits := deepCopy (default dict .resources.limits) }}
{{- if .accelerator.resource }}
{{- $_ := set $limits .accelerator.resource (int .accelerator.count | toString) }}
{{- end }}
{{- with .resources.requests }}
requests:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $limits }}
limits:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level placement shared by both tiers: one node for the whole MegaPod. */}}
{{- define "megapod.placement" -}}
{{- with .Values.placement.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.placement.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.placement.sameNode }}
affinity:
  podAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            app.kubernetes.io/instance: {{ .Release.Name }}
            app.kubernetes.io/part-of: orpheus-megapod
{{- end }}
{{- with .Values.placement.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.placement.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end }}

{{/* Seconds a terminating pod gets: the preStop sleep, the server's drain, and a margin to exit. */}}
{{- define "megapod.terminationGrace" -}}
{{- add (int .drain.preStopSleepS) (int (ceil .server.graceS)) 15 }}
{{- end }}

{{/* Rollouts never surge: a full 8-GPU node has no spare GPU or MIG instance for an extra pod. */}}
{{- define "megapod.strategy" -}}
strategy:
  type: RollingUpdate
  rollingUpdate:
    maxSurge: 0
    maxUnavailable: 1
{{- end }}
