//! The topology suite's static pods: containers asking for EFAs, GPUs and CPUs, each writing
//! what it got where the suite reads it.

use std::path::Path;

use serde_json::{Map, Value, json};

use super::{GPU, GPU_ENV};
use crate::node::RESOURCE;

/// A container of a topology pod. Without CPUs the pod is BestEffort; a pod whose every
/// container asks for CPUs is Guaranteed.
#[derive(Clone, Copy, Debug)]
pub struct Container {
    pub name: &'static str,
    init: bool,
    efas: u32,
    gpus: u32,
    cpus: u32,
}

impl Container {
    pub const fn app(name: &'static str, efas: u32, gpus: u32) -> Container {
        Container {
            name,
            init: false,
            efas,
            gpus,
            cpus: 0,
        }
    }

    pub const fn init(name: &'static str, efas: u32, gpus: u32) -> Container {
        Container {
            init: true,
            ..Container::app(name, efas, gpus)
        }
    }

    /// Asks for `cpus` CPUs (and 32Mi of memory) too.
    pub const fn with_cpus(self, cpus: u32) -> Container {
        Container { cpus, ..self }
    }

    /// Writes the GPU stand-in's variable, the CPUs it may run on and its `/dev/infiniband`
    /// into `/out/<name>.gpu`, `.cpus` and `.ls`; an app container then sleeps.
    fn spec(&self) -> Value {
        let mut limits = Map::new();
        if self.efas > 0 {
            limits.insert(RESOURCE.into(), self.efas.into());
        }
        if self.gpus > 0 {
            limits.insert(GPU.into(), self.gpus.into());
        }
        if self.cpus > 0 {
            limits.insert("cpu".into(), self.cpus.to_string().into());
            limits.insert("memory".into(), "32Mi".into());
        }
        let name = self.name;
        let rest = if self.init {
            "true"
        } else {
            "exec sleep 100000"
        };
        let script = format!(
            "echo \"${{{GPU_ENV}-}}\" >/out/{name}.gpu; \
             sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status >/out/{name}.cpus; \
             ls /dev/infiniband >/out/{name}.ls 2>&1; {rest}"
        );
        json!({
            "name": name, "image": "localhost/busybox:1", "imagePullPolicy": "Never",
            "command": ["sh", "-c", script],
            "resources": {"limits": limits},
            "volumeMounts": [{"name": "out", "mountPath": "/out"}]})
    }
}

/// The static pod `name`, its containers writing into `out`. A bare pod: a rejected one is not
/// retried.
pub fn manifest(name: &str, out: &Path, containers: &[Container]) -> Value {
    let (init, apps): (Vec<&Container>, Vec<&Container>) = containers.iter().partition(|c| c.init);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "hostNetwork": true, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "initContainers": init.iter().map(|c| c.spec()).collect::<Vec<_>>(),
            "containers": apps.iter().map(|c| c.spec()).collect::<Vec<_>>(),
            "volumes": [{"name": "out", "hostPath": {"path": out, "type": "Directory"}}]}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_asks_for_what_its_containers_ask() {
        let pod = manifest(
            "t10",
            Path::new("/run/out/t10"),
            &[
                Container::init("setup", 1, 0),
                Container::app("job", 2, 1).with_cpus(1),
            ],
        );
        let spec = &pod["spec"];
        assert_eq!(spec["initContainers"][0]["name"], "setup");
        assert_eq!(
            spec["initContainers"][0]["resources"]["limits"],
            json!({RESOURCE: 1})
        );
        assert_eq!(
            spec["containers"][0]["resources"]["limits"],
            json!({RESOURCE: 2, GPU: 1, "cpu": "1", "memory": "32Mi"})
        );
        let script = spec["containers"][0]["command"][2].as_str().unwrap();
        assert!(script.starts_with("echo \"${NVIDIA_VISIBLE_DEVICES-}\" >/out/job.gpu;"));
        assert!(script.ends_with("ls /dev/infiniband >/out/job.ls 2>&1; exec sleep 100000"));
        assert_eq!(spec["volumes"][0]["hostPath"]["path"], "/run/out/t10");
    }
}
