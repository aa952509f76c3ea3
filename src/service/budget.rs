//! The start-up budget: whether a sharing count keeps the device list within the kubelet's
//! message limit and the plugin within the pod's memory limit.
//!
//! The figure for each part of the plugin whose memory grows with the advertised IDs lives
//! next to its owner (`cdi`, `holdings`, `allocation::recent`); this module only adds them up.

use std::num::NonZeroU32;

use super::{advertised, encoded_len};
use crate::allocation::recent;
use crate::allocation::sharing::Sharing;
use crate::proto::deviceplugin::UNHEALTHY;
use crate::state::Inventory;
use crate::{cdi, holdings};

/// The kubelet reads ListAndWatch with gRPC's default receive limit and drops a stream whose
/// message is larger, every time it is sent.
pub(crate) const KUBELET_MESSAGE_LIMIT: usize = 4 << 20;

/// The memory limit the shipped manifests give the pod; a test holds them to it.
pub(crate) const POD_MEMORY_LIMIT: usize = 64 << 20;

/// The share of [`POD_MEMORY_LIMIT`] the device list may take at its peak: the rest is for the
/// plugin itself, scrapes, Allocate and GetPreferredAllocation requests, and allocator slack.
const LIST_MEMORY_BUDGET: usize = POD_MEMORY_LIMIT / 4 * 3;

/// What the plugin holds besides its device list, measured (VmHWM) with no sharing.
const BASE_MEMORY: usize = BASE_MEMORY_MIB << 20;
const BASE_MEMORY_MIB: usize = 8;

/// Copies of the encoded list alive at a change at most: the current frame, the one being
/// encoded, and one a slow stream still holds.
const LIST_COPIES: usize = 3;

/// Refuses a sharing count under which the device list of `inventory` could exceed
/// [`KUBELET_MESSAGE_LIMIT`], or the memory it takes at its peak (in cdi mode, with the spec
/// writer's; with every ID held, the PodResources view's; with every ID given out lately, the
/// record of them) the pod's limit. Sized for the worst
/// case, every ID `Unhealthy` (the longest health), so no health change can push a list that
/// passed over either. The reason starts with the count, for the caller to name the setting.
pub(crate) fn check_sharing_fits(
    inventory: &Inventory,
    sharing: Sharing,
    cdi: bool,
) -> Result<(), String> {
    let size = |sharing: Sharing| {
        encoded_len(advertised(inventory, sharing).map(|mut device| {
            device.health = UNHEALTHY.into();
            device
        }))
    };
    let memory = |sharing: Sharing| {
        let efas = inventory.devices().len();
        let ids = efas * sharing.replicas.get() as usize;
        let spec = if cdi { ids * cdi::PEAK_BYTES_PER_ID } else { 0 };
        let recent = efas * recent::PEAK_BYTES_PER_EFA + ids * recent::PEAK_BYTES_PER_ID;
        BASE_MEMORY
            + LIST_COPIES * size(sharing)
            + spec
            + ids * holdings::PEAK_BYTES_PER_ID
            + recent
    };
    let fits = |sharing: Sharing| {
        size(sharing) <= KUBELET_MESSAGE_LIMIT && memory(sharing) <= LIST_MEMORY_BUDGET
    };
    if fits(sharing) {
        return Ok(());
    }
    let replicas = sharing.replicas.get();
    // Both grow with the count, so the largest that fits is found by bisection.
    let fitting = (1..replicas)
        .collect::<Vec<_>>()
        .partition_point(|&r| NonZeroU32::new(r).is_some_and(|r| fits(Sharing::replicas(r))));
    let efas = inventory.devices().len();
    let worst = size(sharing);
    let why = if worst > KUBELET_MESSAGE_LIMIT {
        format!(
            "{efas} EFAs make a device list of up to {worst} bytes, over the kubelet's {KUBELET_MESSAGE_LIMIT}-byte message limit"
        )
    } else {
        format!(
            "{efas} EFAs{} need about {} MiB at a change, over the {} MiB of the pod's {} MiB memory limit the device list may take",
            if cdi { " in cdi mode" } else { "" },
            memory(sharing) >> 20,
            LIST_MEMORY_BUDGET >> 20,
            POD_MEMORY_LIMIT >> 20,
        )
    };
    Err(format!("{replicas}: {why}; at most {fitting} fit"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::sharing::shared;
    use crate::testkit::simulate::{Shape, inventory};

    #[test]
    fn a_cdi_spec_too_large_for_the_pods_memory_is_refused_with_the_largest_count_that_fits() {
        // The most EFAs whose list at 64 replicas fits the kubelet's message limit.
        let dense = inventory(Shape::Dense(1780));
        let fits = |replicas, cdi| check_sharing_fits(&dense, shared(replicas), cdi);
        assert_eq!(fits(64, false), Ok(()));
        let refused = fits(64, true).unwrap_err();
        assert!(refused.starts_with("64:"), "{refused}");
        assert!(
            refused.contains("cdi mode") && refused.contains("64 MiB"),
            "{refused}"
        );
        let fitting: u32 = refused
            .rsplit("at most ")
            .next()
            .unwrap()
            .trim_end_matches(" fit")
            .parse()
            .unwrap();
        assert!((1..64).contains(&fitting), "{refused}");
        assert_eq!(fits(fitting, true), Ok(()));
        assert!(fits(fitting + 1, true).is_err());
    }

    #[test]
    fn the_budget_counts_the_pod_view_with_every_id_held() {
        // Fits with the spec writer's share alone; with every ID held, 540 EFAs at 64 replicas
        // would take about 6 MiB more than the pod's share has left.
        let refused =
            check_sharing_fits(&inventory(Shape::Dense(540)), shared(64), true).unwrap_err();
        assert!(refused.contains("in cdi mode need about"), "{refused}");
    }

    #[test]
    fn the_budget_counts_the_record_of_ids_given_out_lately() {
        // 494 EFAs at 64 replicas in cdi mode fit by 0.3 MiB without the record; with every ID
        // given out within its window it takes 0.6 MiB more.
        let refused =
            check_sharing_fits(&inventory(Shape::Dense(494)), shared(64), true).unwrap_err();
        assert!(refused.contains("in cdi mode need about"), "{refused}");
    }

    /// The budget is a share of the limit the shipped manifests set: both must name one figure.
    #[test]
    fn the_pod_memory_limit_is_the_one_the_manifests_set() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests");
        let read = |file: &str| -> serde_yaml::Value {
            serde_yaml::from_str(&std::fs::read_to_string(root.join(file)).unwrap()).unwrap()
        };
        let daemonset = read("base/daemonset.yaml");
        let values = read("helm/efa-device-plugin/values.yaml");
        let limits = [
            &daemonset["spec"]["template"]["spec"]["containers"][0]["resources"],
            &values["resources"],
        ]
        .map(|resources| resources["limits"]["memory"].as_str().map(str::to_owned));
        let ours = format!("{}Mi", POD_MEMORY_LIMIT >> 20);
        assert_eq!(limits, [Some(ours.clone()), Some(ours)]);
    }
}
