{{/* Names: <release>-tokenyard, or the release name alone when it already says tokenyard. */}}
{{- define "tokenyard.fullname" -}}
{{- if contains "tokenyard" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-tokenyard" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokenyard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tokenyard.labels" -}}
app.kubernetes.io/part-of: tokenyard
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The broker for every tokenyard container: the embedded Valkey's pod, or the external URL. */}}
{{- define "tokenyard.brokerEnv" -}}
{{- if eq .Values.broker.mode "embedded" -}}
- name: TOKENYARD_BROKER_URL
  value: {{ printf "redis://%s-valkey-0.%s-valkey:6379/0" (include "tokenyard.fullname" .) (include "tokenyard.fullname" .) | quote }}
{{- else if eq .Values.broker.mode "external" -}}
{{- if .Values.broker.existingSecret -}}
- name: TOKENYARD_BROKER_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.broker.existingSecret }}, key: url}
{{- else -}}
- name: TOKENYARD_BROKER_URL
  value: {{ required "broker.mode external needs broker.url or broker.existingSecret" .Values.broker.url | quote }}
{{- end }}
{{- with .Values.broker.tablesUrl }}
- name: TOKENYARD_BROKER_TABLES_URL
  value: {{ . | quote }}
{{- end }}
{{- else -}}
{{- fail "broker.mode is embedded or external" -}}
{{- end }}
- name: TOKENYARD_BROKER_PREFIX
  value: {{ .Values.broker.prefix | quote }}
{{- end -}}

{{- define "tokenyard.adminKeySecret" -}}
{{- if .Values.metrics.adminKey.existingSecret -}}
{{- .Values.metrics.adminKey.existingSecret -}}
{{- else if .Values.metrics.adminKey.value -}}
{{- printf "%s-admin-key" (include "tokenyard.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The model volume, mounted read-only at /models. */}}
{{- define "tokenyard.modelVolume" -}}
{{- if eq .Values.modelVolume.type "pvc" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-models" (include "tokenyard.fullname" .)) .Values.modelVolume.existingClaim }}
    readOnly: true
{{- else if eq .Values.modelVolume.type "hostPath" -}}
- name: models
  hostPath:
    path: {{ required "modelVolume.type hostPath needs modelVolume.hostPath" .Values.modelVolume.hostPath | quote }}
    type: Directory
{{- else if ne .Values.modelVolume.type "none" -}}
{{- fail "modelVolume.type is none, pvc or hostPath" -}}
{{- end -}}
{{- end -}}

{{- define "tokenyard.modelMount" -}}
{{- if ne .Values.modelVolume.type "none" -}}
- {name: models, mountPath: /models, readOnly: true}
{{- end -}}
{{- end -}}
