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
{{- define "megapod.frontName" -}}{{ include "megapod.fullname" . | trunc 57 }}-front{{- end }}

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
servers read each field of their settings model from exactly that variable. Whole floats print
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

{{/* Draining, the same for every tier (values drain): seconds a terminating pod gets, the
endpoint delay, the server's drain and a margin to exit. Call with the root context. */}}
{{- define "megapod.terminationGrace" -}}
{{- add (int (ceil .Values.drain.endpointDelayS)) (int (ceil .Values.drain.graceS)) 15 }}
{{- end }}

{{/* preStop: keep serving, new streams included, while the pod's address leaves the Services'
endpoints, DNS and the load balancers (they learn of it only after the pod starts terminating);
SIGTERM follows, and the server drains for drain.graceS. */}}
{{- define "megapod.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.drain.endpointDelayS | toString | quote }}]
{{- end }}

{{/* Rollouts never surge: a full 8-GPU node has no spare GPU or MIG instance for an extra pod. */}}
{{- define "megapod.strategy" -}}
strategy:
  type: RollingUpdate
  rollingUpdate:
    maxSurge: 0
    maxUnavailable: 1
{{- end }}

{{/* ------------------------------------------------------------------ codec TLS (mutual)

Where the codec tier's certificates come from: "existing" (codecTls.existingSecret), "certManager"
(Certificate resources), or "generated" (by Helm, kept across upgrades through lookup). */}}
{{- define "megapod.codecTlsSource" -}}
{{- $tls := .Values.codecTls }}
{{- if and $tls.existingSecret $tls.certManager.enabled }}
{{- fail "codecTls: set existingSecret or certManager.enabled, not both" }}
{{- end }}
{{- if $tls.existingSecret }}existing{{ else if $tls.certManager.enabled }}certManager{{ else }}generated{{ end }}
{{- end }}

{{- define "megapod.codecTlsSecretName" -}}{{ include "megapod.fullname" . | trunc 52 | trimSuffix "-" }}-codec-tls{{- end }}

{{/* The name the LLM workers check in the SNAC replicas' certificates: the host of ORPHEUS_SNAC. */}}
{{- define "megapod.codecTlsServerName" -}}
{{- .Values.codecTls.serverName | default (printf "%s.$(POD_NAMESPACE).svc.%s" (include "megapod.snacName" .) .Values.clusterDomain) }}
{{- end }}

{{/* DNS names in the SNAC server certificate (generated or cert-manager). */}}
{{- define "megapod.codecTlsDnsNames" -}}
{{- $snac := include "megapod.snacName" . }}
{{- $ns := .Release.Namespace }}
{{- $names := list $snac (printf "%s.%s" $snac $ns) (printf "%s.%s.svc" $snac $ns) (printf "%s.%s.svc.%s" $snac $ns .Values.clusterDomain) }}
{{- with .Values.codecTls.serverName }}{{ $names = append $names . }}{{ end }}
{{- toJson ($names | uniq) }}
{{- end }}

{{/* The secret volume of one side: (dict "ctx" $ "side" "server"|"client"). The same three files,
ca.crt, tls.crt and tls.key, whatever the source. No subPath anywhere: kubelet then replaces the
files in place when the Secret changes, and the servers re-read them. */}}
{{- define "megapod.codecTlsVolume" -}}
{{- $ctx := .ctx }}
{{- $tls := $ctx.Values.codecTls }}
{{- $source := include "megapod.codecTlsSource" $ctx }}
{{- $name := include "megapod.codecTlsSecretName" $ctx }}
- name: codec-tls
  secret:
    {{- if eq $source "existing" }}
    secretName: {{ if eq .side "client" }}{{ $tls.existingClientSecret | default $tls.existingSecret }}{{ else }}{{ $tls.existingSecret }}{{ end }}
    {{- else if eq $source "certManager" }}
    secretName: {{ printf "%s-%s" $name .side }}
    {{- else }}
    secretName: {{ $name }}
    {{- end }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      {{- if eq $source "generated" }}
      - {key: {{ .side }}.crt, path: tls.crt}
      - {key: {{ .side }}.key, path: tls.key}
      {{- else }}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- end }}
{{- end }}

{{- define "megapod.codecTlsDir" -}}/etc/orpheus-megapod/codec-tls{{- end }}

{{/* One SNAC probe: the kubelet's own grpc probe on the plaintext health-only port (the TLS port
would need a client certificate). Call with (dict "ctx" $ "service" "..." "probe" $snac.probes.readiness). */}}
{{- define "megapod.snacProbe" -}}
grpc:
  port: {{ .ctx.Values.snac.server.healthPort }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{ toYaml .probe }}
{{- end }}

{{/* Pod annotation rolling both tiers when Helm-generated certificates change (opt-in: the servers
re-read their files, so a restart is not needed). */}}
{{- define "megapod.podAnnotations" -}}
{{- if and .Values.codecTls.enabled .Values.codecTls.restartOnChange (eq (include "megapod.codecTlsSource" .) "generated") }}
annotations:
  checksum/codec-tls: {{ include "megapod.codecTlsData" . | sha256sum }}
{{- end }}
{{- end }}

{{/* The generated Secret's data: the existing Secret's when there is one (lookup; `helm install`
and `helm upgrade` keep the certificates), else a fresh CA and leaf certificates. `helm template`
and dry runs cannot look up, so they print fresh ones every time. Rendered once per run. */}}
{{- define "megapod.codecTlsData" -}}
{{- if not (hasKey .Values.codecTls "_rendered") }}
{{- $_ := set .Values.codecTls "_rendered" (include "megapod.codecTlsNewData" .) }}
{{- end }}
{{- get .Values.codecTls "_rendered" }}
{{- end }}

{{- define "megapod.codecTlsNewData" -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "megapod.codecTlsSecretName" .) }}
{{- $keys := list "ca.crt" "server.crt" "server.key" "client.crt" "client.key" }}
{{- $data := dict }}
{{- if $existing }}
{{- $data = pick ($existing.data | default dict) "ca.crt" "server.crt" "server.key" "client.crt" "client.key" }}
{{- end }}
{{- if ne (len $data) (len $keys) }}
{{- $g := .Values.codecTls.generated }}
{{- $ca := genCA (printf "%s codec CA" (include "megapod.fullname" .)) (int $g.caValidityDays) }}
{{- $server := genSignedCert (include "megapod.snacName" .) nil (include "megapod.codecTlsDnsNames" . | fromJsonArray) (int $g.certValidityDays) $ca }}
{{- $client := genSignedCert (include "megapod.llmName" .) nil (list (include "megapod.llmName" .)) (int $g.certValidityDays) $ca }}
{{- $data = dict "ca.crt" ($ca.Cert | b64enc) "server.crt" ($server.Cert | b64enc) "server.key" ($server.Key | b64enc) "client.crt" ($client.Cert | b64enc) "client.key" ($client.Key | b64enc) }}
{{- end }}
{{- toYaml $data }}
{{- end }}
