//! What the suite checks of the plugin's pod spec: a test install (overlay or values, rendered)
//! differs from the shipped one only by the image and the fake sysfs tree, and the running pod
//! keeps the shipped securityContext.

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_json::{Value, json};

use super::kube::Pod;

/// The plugin's container in the shipped DaemonSet.
const PLUGIN_CONTAINER: &str = "efa-device-plugin";
/// What the test overlays and values add, and nothing else may differ.
const SYSFS_VOLUME: &str = "e2e-sysfs";
const SYSFS_ARG: &str = "--sysfs-root=/e2e-sysfs";

/// The objects of rendered manifests (`kubectl kustomize`, `helm template`), empty documents
/// left out.
pub fn load(yaml: &str) -> Result<Vec<Value>> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|document| Value::deserialize(document).context("rendered manifests: not YAML"))
        .filter(|object| !matches!(object, Ok(Value::Null)))
        .collect()
}

fn kind_and_name(object: &Value) -> (String, String) {
    let text = |value: &Value| value.as_str().unwrap_or_default().to_owned();
    (text(&object["kind"]), text(&object["metadata"]["name"]))
}

fn daemonset(objects: &[Value]) -> Result<&Value> {
    let found: Vec<&Value> = objects
        .iter()
        .filter(|object| object["kind"] == "DaemonSet")
        .collect();
    ensure!(
        found.len() == 1,
        "expected one DaemonSet, found {}",
        found.len()
    );
    Ok(found[0])
}

fn plugin_container(pod_spec: &mut Value) -> Result<&mut Value> {
    pod_spec["containers"]
        .as_array_mut()
        .into_iter()
        .flatten()
        .find(|container| container["name"] == PLUGIN_CONTAINER)
        .with_context(|| format!("no container named {PLUGIN_CONTAINER}"))
}

/// The pod's and the plugin container's securityContext, as the rendered DaemonSet sets them
/// (null where it sets none).
pub fn shipped_security_context(objects: &[Value]) -> Result<Value> {
    let mut pod = daemonset(objects)?["spec"]["template"]["spec"].clone();
    let container = plugin_container(&mut pod)?["securityContext"].clone();
    Ok(json!({"pod": pod["securityContext"], "container": container}))
}

/// The same of a running plugin pod.
pub fn security_context(pod: &Pod) -> Result<Value> {
    let container = pod
        .spec
        .containers
        .iter()
        .find(|container| container.name == PLUGIN_CONTAINER)
        .with_context(|| {
            format!(
                "pod {} has no container {PLUGIN_CONTAINER}",
                pod.metadata.name
            )
        })?;
    Ok(json!({"pod": pod.spec.security_context, "container": container.security_context}))
}

/// `test`, the rendered test install, has the objects of `shipped` and differs from it only by
/// the plugin's image and exactly one sysfs volume, mount and argument; the error names the
/// first other difference.
pub fn compare(shipped: &[Value], test: &[Value]) -> Result<()> {
    let mut shipped_keys: Vec<_> = shipped.iter().map(kind_and_name).collect();
    let mut test_keys: Vec<_> = test.iter().map(kind_and_name).collect();
    shipped_keys.sort();
    test_keys.sort();
    ensure!(
        shipped_keys == test_keys,
        "objects differ: shipped {shipped_keys:?}, test {test_keys:?}"
    );
    for object in test {
        let key = kind_and_name(object);
        let mut want = shipped
            .iter()
            .find(|shipped| kind_and_name(shipped) == key)
            .context("no shipped object")?
            .clone();
        let mut got = object.clone();
        if key.0 == "DaemonSet" {
            without_test_additions(&mut got)?;
            without_image(&mut want)?;
        }
        if let Some(at) = first_difference(&want, &got, "") {
            bail!(
                "the test {}/{} differs from the shipped one at {at}",
                key.0,
                key.1
            );
        }
    }
    Ok(())
}

fn without_image(daemonset: &mut Value) -> Result<()> {
    let container = plugin_container(&mut daemonset["spec"]["template"]["spec"])?;
    if let Some(fields) = container.as_object_mut() {
        fields.remove("image");
    }
    Ok(())
}

/// Removes the test's sysfs volume, mount and argument (exactly one of each) and the image.
fn without_test_additions(daemonset: &mut Value) -> Result<()> {
    let pod = &mut daemonset["spec"]["template"]["spec"];
    remove_one(&mut pod["volumes"], |v| v["name"] == SYSFS_VOLUME)?;
    let container = plugin_container(pod)?;
    remove_one(&mut container["volumeMounts"], |m| {
        m["name"] == SYSFS_VOLUME
    })?;
    remove_one(&mut container["args"], |a| a == SYSFS_ARG)?;
    without_image(daemonset)
}

fn remove_one(list: &mut Value, added: impl Fn(&Value) -> bool) -> Result<()> {
    let items = list.as_array_mut().map(|items| {
        let before = items.len();
        items.retain(|item| !added(item));
        before - items.len()
    });
    ensure!(
        items == Some(1),
        "the test install must add exactly one {SYSFS_VOLUME} volume, mount and {SYSFS_ARG}"
    );
    Ok(())
}

/// Where `b` first differs from `a` (`/spec/template/...`), if it does.
fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    let here = || {
        if path.is_empty() {
            "/".to_owned()
        } else {
            path.to_owned()
        }
    };
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .find_map(|key| match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => first_difference(x, y, &format!("{path}/{key}")),
                    _ => Some(format!("{path}/{key}")),
                })
        }
        (Value::Array(a), Value::Array(b)) if a.len() != b.len() => {
            Some(format!("{path} (length {} vs {})", a.len(), b.len()))
        }
        (Value::Array(a), Value::Array(b)) => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (x, y))| first_difference(x, y, &format!("{path}/{i}"))),
        (a, b) if std::mem::discriminant(a) != std::mem::discriminant(b) => Some(here()),
        (a, b) => (a != b).then(here),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIPPED: &str = "\
kind: ServiceAccount
metadata: {name: efa-device-plugin}
---
kind: DaemonSet
metadata: {name: efa-device-plugin}
spec:
  template:
    spec:
      securityContext: {runAsUser: 0}
      volumes: [{name: dp}]
      containers:
      - name: efa-device-plugin
        image: public/efa-device-plugin:v1
        args: [--log-format=json]
        securityContext: {privileged: false}
        volumeMounts: [{name: dp, mountPath: /dp}]
";

    fn with_test_tree(shipped: &str) -> String {
        shipped
            .replace("volumes: [{name: dp}]", "volumes: [{name: dp}, {name: e2e-sysfs}]")
            .replace(
                "args: [--log-format=json]",
                "args: [--log-format=json, --sysfs-root=/e2e-sysfs]",
            )
            .replace(
                "volumeMounts: [{name: dp, mountPath: /dp}]",
                "volumeMounts: [{name: dp, mountPath: /dp}, {name: e2e-sysfs, mountPath: /e2e-sysfs}]",
            )
            .replace("public/efa-device-plugin:v1", "localhost/efa-device-plugin:e2e")
    }

    #[test]
    fn a_test_install_may_differ_by_the_image_and_the_tree_alone() {
        let shipped = load(SHIPPED).unwrap();
        compare(&shipped, &load(&with_test_tree(SHIPPED)).unwrap()).unwrap();
        let privileged = with_test_tree(SHIPPED).replace("privileged: false", "privileged: true");
        assert_eq!(
            compare(&shipped, &load(&privileged).unwrap())
                .unwrap_err()
                .to_string(),
            "the test DaemonSet/efa-device-plugin differs from the shipped one at \
             /spec/template/spec/containers/0/securityContext/privileged"
        );
        let err = compare(&shipped, &shipped).unwrap_err().to_string();
        assert!(err.contains("exactly one e2e-sysfs volume"), "{err}");
    }

    #[test]
    fn the_shipped_security_context_is_the_pods_and_the_containers() {
        let shipped = load(SHIPPED).unwrap();
        assert_eq!(
            shipped_security_context(&shipped).unwrap(),
            json!({"pod": {"runAsUser": 0}, "container": {"privileged": false}})
        );
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "efa-device-plugin-x"},
            "spec": {
                "securityContext": {"runAsUser": 0},
                "containers": [{"name": "efa-device-plugin", "securityContext": {"privileged": false}}],
            },
        }))
        .unwrap();
        assert_eq!(
            security_context(&pod).unwrap(),
            shipped_security_context(&shipped).unwrap()
        );
    }
}
