{{/* Full name of the release's objects, at most 63 characters. */}}
{{- define "minedraft.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "minedraft.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "minedraft.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The tag of the three images: image.tag, else the chart's appVersion (the package version, make's TAG). */}}
{{- define "minedraft.imageTag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "minedraft.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "minedraft.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Whether to render a monitoring.coreos.com/v1 object of a kind: (list SETTING KIND $). SETTING true or false decides;
"auto" renders it only when the cluster serves that kind (the Prometheus operator's CRDs are installed), so the
default install succeeds on a plain cluster. Prints "true" or nothing.
*/}}
{{- define "minedraft.monitoringEnabled" -}}
{{- $setting := toString (index . 0) -}}
{{- $kind := index . 1 -}}
{{- $root := index . 2 -}}
{{- if eq $setting "true" -}}
true
{{- else if and (eq $setting "auto") ($root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $kind)) -}}
true
{{- end -}}
{{- end -}}

{{/* k=v,k2=v2 from a map, for the operator's label flags. */}}
{{- define "minedraft.labelArg" -}}
{{- $pairs := list -}}
{{- range $k, $v := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/*
The operator's permissions: exactly minedraft.operator.kube.PERMISSIONS (a test compares them).
Server-side apply needs patch, plus create for objects that do not exist yet; delete removes objects no longer
rendered and replaces a Deployment whose (immutable) selector changed. endpointslices: the operator creates each
gateway's Role granting these, and Kubernetes only lets it grant what it holds itself. pods list: why a rollout is
stuck (the Progressing condition); events list: the kubelet's and attach/detach controller's FailedMount and
FailedAttachVolume events for those pods (a missing Secret volume, a Multi-Attach). minedrafts/finalizers update: OwnerReferencesPermissionEnforcement (OpenShift)
requires it to set blockOwnerDeletion. No Secrets: pods reference them and the kubelet reads them.
*/}}
{{- define "minedraft.rules" -}}
- apiGroups: ["minedraft.io"]
  resources: ["minedrafts"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["minedraft.io"]
  resources: ["minedrafts/status"]
  verbs: ["patch"]
- apiGroups: ["minedraft.io"]
  resources: ["minedrafts/scale"]
  verbs: ["patch"]
- apiGroups: ["minedraft.io"]
  resources: ["minedrafts/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
{{- end -}}

{{/*
The engine pods' fsGroup as the operator's --pod-fs-group takes it ("" for none): operator.enginePodFsGroup, where
"auto" is 65532 (the images' user id; any GID works) except on OpenShift, whose SCC assigns the fsGroup.
*/}}
{{- define "minedraft.enginePodFsGroup" -}}
{{- $value := .Values.operator.enginePodFsGroup -}}
{{- if eq (toString $value) "auto" -}}
{{- if not (.Capabilities.APIVersions.Has "security.openshift.io/v1/SecurityContextConstraints") -}}65532{{- end -}}
{{- else if $value -}}
{{- int64 $value -}}
{{- end -}}
{{- end -}}
