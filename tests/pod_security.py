"""The Pod Security Standards' checks (Kubernetes' PodSecurity admission, profiles "baseline" and "restricted",
policy version "latest" as documented for Kubernetes 1.25+), as a pure function over a pod spec, plus the extra
rule of clusters that assign arbitrary UIDs (OpenShift's restricted-v2 SCC: a fixed UID/GID is refused unless it
happens to fall in the namespace's range, so a portable pod fixes none).

`restricted_violations(pod_spec, pod_annotations)` returns one message per violated control (empty: a namespace
labelled pod-security.kubernetes.io/enforce=restricted admits the pod). Linux pods only (spec.os.name windows
relaxes some controls; not modelled).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# Capabilities baseline lets a container add (the container runtimes' default set).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# restricted: only these volume sources.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
VOLUME_META_KEYS = {"name"}


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            yield f"{kind}[{container.get('name', '?')}]", container


def baseline_violations(spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> list[str]:
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    annotations = annotations or {}
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("spec.securityContext.windowsOptions.hostProcess must not be true")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"spec.{field} must not be true")
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"volume {volume.get('name')}: hostPath volumes are forbidden")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not in the safe set")
    for where, sc in [("spec.securityContext", pod_sc)] + [
            (f"{w}.securityContext", c.get("securityContext") or {}) for w, c in _containers(spec)]:
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"{where}.seLinuxOptions: custom SELinux options are forbidden")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}.seccompProfile must not be Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}.appArmorProfile must not be Unconfined")
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value == "runtime/default" or value.startswith("localhost/")):
            out.append(f"annotation {key}: AppArmor profile {value!r} is not allowed")
    for where, container in _containers(spec):
        sc = container.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess must not be true")
        if sc.get("privileged"):
            out.append(f"{where}: privileged must not be true")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            out.append(f"{where}: capabilities {sorted(added)} may not be added")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount must be Default")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']} is forbidden")
    return out


def restricted_violations(spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> list[str]:
    out = baseline_violations(spec, annotations)
    pod_sc = spec.get("securityContext") or {}
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - VOLUME_META_KEYS
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume.get('name')}: type {sorted(kinds - RESTRICTED_VOLUMES)} is not allowed")
    if pod_sc.get("runAsUser") == 0:
        out.append("spec.securityContext.runAsUser must not be 0")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ("RuntimeDefault", "Localhost"):
        out.append("spec.securityContext.seccompProfile.type must be RuntimeDefault or Localhost")
    for where, container in _containers(spec):
        sc = container.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation must be false")
        if sc.get("runAsNonRoot") is False or (not pod_non_root and sc.get("runAsNonRoot") is not True):
            out.append(f"{where}: runAsNonRoot must be true (on the pod or the container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile.type must be RuntimeDefault or Localhost")
        if seccomp is None and pod_seccomp is None:
            out.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost (on the pod or the container)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities.drop must include ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: only NET_BIND_SERVICE may be added")
    return out


def fixed_id_violations(spec: Mapping[str, Any]) -> list[str]:
    """Fields that pin a UID/GID: refused where the cluster assigns arbitrary ones (OpenShift restricted-v2)."""
    out = [f"spec.securityContext.{f} is fixed" for f in ("runAsUser", "runAsGroup", "fsGroup")
           if f in (spec.get("securityContext") or {})]
    if (spec.get("securityContext") or {}).get("supplementalGroups"):
        out.append("spec.securityContext.supplementalGroups is fixed")
    for where, container in _containers(spec):
        out += [f"{where}.securityContext.{f} is fixed" for f in ("runAsUser", "runAsGroup")
                if f in (container.get("securityContext") or {})]
    return out


def writable_path_violations(spec: Mapping[str, Any]) -> list[str]:
    """Containers must run with a read-only root filesystem (every writable path on a volume)."""
    return [f"{where}: readOnlyRootFilesystem must be true" for where, c in _containers(spec)
            if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True]
