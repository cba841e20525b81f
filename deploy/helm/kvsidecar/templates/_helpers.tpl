{{/* The release's object name: <release>-<chart>, or fullnameOverride. */}}
{{- define "kvsidecar.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvsidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* What selects this release's engine pods (Deployment, Service, PodMonitor). */}}
{{- define "kvsidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvsidecar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvsidecar.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvsidecar.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
The kvsidecar container: a native sidecar (an initContainers entry with
restartPolicy: Always) reading the segment volume read-only. No probes, on purpose:
the kubelet starts the engine once this container is "started" (a startupProbe would
hold the engine back while it fails), and a native sidecar's readiness counts in the
Pod's Ready condition (readiness, or a liveness restart, would take the engine out of
its Service). holdOnError keeps a misconfigured sidecar running and saying why.
*/}}
{{- define "kvsidecar.sidecar" -}}
- name: kvsidecar
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  restartPolicy: Always
  args:
    - serve
    {{- range .Values.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: KVSIDECAR_SHM_DIR
      value: {{ .Values.segments.mountPath | quote }}
    - name: KVSIDECAR_WEB_LISTEN_ADDRESS
      value: {{ printf ":%d" (int .Values.port) | quote }}
    - name: KVSIDECAR_ALLOW_UID
      value: {{ .Values.engine.runAsUser | int | quote }}
    - name: KVSIDECAR_LOG_LEVEL
      value: {{ .Values.logLevel | quote }}
    - name: KVSIDECAR_HOLD_ON_ERROR
      value: {{ .Values.holdOnError | toString | quote }}
    {{- if .Values.gateway.enabled }}
    - name: KVSIDECAR_GATEWAY_LISTEN_ADDRESS
      value: {{ printf ":%d" (int .Values.gateway.port) | quote }}
    {{- with .Values.gateway.role }}
    - name: KVSIDECAR_GATEWAY_ROLE
      value: {{ . | quote }}
    {{- end }}
    {{- if .Values.gateway.tlsSecret }}
    - name: KVSIDECAR_GATEWAY_WEB_CONFIG_FILE
      value: /etc/kvsidecar/gateway-tls/web-config.yml
    {{- end }}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: metrics
      containerPort: {{ .Values.port }}
      protocol: TCP
    {{- if .Values.gateway.enabled }}
    - name: gateway  # for the endpoint picker only, never Prometheus
      containerPort: {{ .Values.gateway.port }}
      protocol: TCP
    {{- end }}
  resources:
    {{- $res := deepCopy .Values.resources }}
    {{- if .Values.gateway.enabled }}
    {{- /* the gateway's polls: docs/gateway.md "The cost of a poll, and sizing" */}}
    {{- $_ := set $res.requests "cpu" .Values.gateway.cpu }}
    {{- $_ := set $res.limits "cpu" .Values.gateway.cpu }}
    {{- end }}
    {{- toYaml $res | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ .Values.runAsUser }}
    runAsGroup: {{ .Values.runAsUser }}
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    privileged: false
    capabilities:
      drop: ["ALL"]
    seccompProfile:
      type: RuntimeDefault
  volumeMounts:
    - name: kvsidecar-shm
      mountPath: {{ .Values.segments.mountPath }}
      readOnly: true
    {{- if and .Values.gateway.enabled .Values.gateway.tlsSecret }}
    - name: kvsidecar-gateway-tls
      mountPath: /etc/kvsidecar/gateway-tls
      readOnly: true
    {{- end }}
    {{- with .Values.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
