"""The Pod Security Standards checks (tests/pod_security.py) themselves: a compliant pod passes, and each control
the restricted profile enforces is caught when broken."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.pod_security import fixed_id_violations, restricted_violations, writable_path_violations


def compliant() -> dict[str, Any]:
    return {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "app", "ports": [{"containerPort": 8080}], "securityContext": {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}}],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "token", "projected": {"sources": []}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
    }


def test_a_compliant_pod_passes() -> None:
    pod = compliant()
    assert restricted_violations(pod) == [] and fixed_id_violations(pod) == [] and writable_path_violations(pod) == []
    # Container-level settings may stand in for the pod's.
    pod["securityContext"] = {}
    pod["containers"][0]["securityContext"].update(runAsNonRoot=True, seccompProfile={"type": "Localhost"})
    assert restricted_violations(pod) == []


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    sc: dict[str, Any] = pod["containers"][0]["securityContext"]
    return sc


BREAKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "hostNetwork": lambda p: p.update(hostNetwork=True),
    "hostPID": lambda p: p.update(hostPID=True),
    "hostPath": lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "nfs volume": lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
    "privileged": lambda p: _container(p).update(privileged=True),
    "escalation unset": lambda p: _container(p).pop("allowPrivilegeEscalation"),
    "escalation true": lambda p: _container(p).update(allowPrivilegeEscalation=True),
    "root allowed": lambda p: p["securityContext"].pop("runAsNonRoot"),
    "container root": lambda p: _container(p).update(runAsNonRoot=False),
    "uid 0": lambda p: _container(p).update(runAsUser=0),
    "no seccomp": lambda p: p["securityContext"].pop("seccompProfile"),
    "unconfined seccomp": lambda p: _container(p).update(seccompProfile={"type": "Unconfined"}),
    "capabilities kept": lambda p: _container(p).pop("capabilities"),
    "capability added": lambda p: _container(p)["capabilities"].update(add=["NET_ADMIN"]),
    "hostPort": lambda p: p["containers"][0]["ports"][0].update(hostPort=80),
    "unsafe sysctl": lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "selinux user": lambda p: p["securityContext"].update(seLinuxOptions={"user": "system_u"}),
    "procMount": lambda p: _container(p).update(procMount="Unmasked"),
    "init container": lambda p: p.update(initContainers=[{"name": "init", "securityContext": {}}]),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_restricted_control_is_enforced(name: str) -> None:
    pod = copy.deepcopy(compliant())
    BREAKS[name](pod)
    assert restricted_violations(pod), name


def test_capability_net_bind_service_may_be_added() -> None:
    pod = compliant()
    _container(pod)["capabilities"]["add"] = ["NET_BIND_SERVICE"]
    assert restricted_violations(pod) == []


def test_fixed_ids_and_writable_root_are_reported() -> None:
    pod = compliant()
    pod["securityContext"].update(runAsUser=1000, fsGroup=1000)
    _container(pod).update(runAsGroup=1000, readOnlyRootFilesystem=False)
    assert restricted_violations(pod) == []  # PodSecurity itself allows a fixed non-zero UID...
    assert len(fixed_id_violations(pod)) == 3  # ...clusters assigning arbitrary UIDs do not
    assert writable_path_violations(pod) == ["containers[app]: readOnlyRootFilesystem must be true"]
