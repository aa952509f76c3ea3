//! Opt-in sharing: each EFA advertised under several IDs, so more containers than EFAs can
//! hold one.
//!
//! The kubelet only counts and hands out IDs; it has no notion of a shared device. With
//! `replicas: N` the EFA `rdmap16s27` is advertised as `rdmap16s27::0` … `rdmap16s27::<N-1>`,
//! each with the EFA's health and NUMA node, and every one of them opens the same uverbs node.

use std::num::NonZeroU32;

use serde::Serialize;

/// Between an EFA's ID and its replica number. Neither ibdev names nor PCI addresses (single
/// colons only) contain it, so the split is unambiguous.
pub(crate) const SEPARATOR: &str = "::";

/// Keeps the device list of the densest node (256 EFAs) to a few hundred kilobytes: the kubelet
/// receives each ListAndWatch snapshot as one gRPC message and checkpoints every ID.
pub(crate) const MAX_REPLICAS: u32 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sharing {
    /// IDs advertised per EFA; 1 means no sharing.
    pub replicas: NonZeroU32,
}

impl Default for Sharing {
    fn default() -> Self {
        Sharing {
            replicas: NonZeroU32::MIN,
        }
    }
}

impl Sharing {
    pub fn replicas(replicas: NonZeroU32) -> Self {
        Sharing { replicas }
    }

    pub fn is_shared(&self) -> bool {
        self.replicas.get() > 1
    }

    /// The IDs the kubelet sees for the EFA `device`.
    pub fn advertised<'a>(&self, device: &'a str) -> impl Iterator<Item = String> + use<'a> {
        let shared = self.is_shared();
        (0..self.replicas.get()).map(move |k| {
            if shared {
                format!("{device}{SEPARATOR}{k}")
            } else {
                device.to_owned()
            }
        })
    }

    /// The EFA an ID stands for and its replica number; `None` for an ID this setting never
    /// advertises (whether the EFA exists is for the inventory to say).
    pub fn parse<'a>(&self, id: &'a str) -> Option<(&'a str, u32)> {
        if !self.is_shared() {
            return Some((id, 0));
        }
        let (device, replica) = id.rsplit_once(SEPARATOR)?;
        // Only the canonical spelling: `::01` or `::+1` would alias an advertised ID.
        let canonical = replica == "0" || !replica.starts_with('0');
        if !canonical || !replica.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let k: u32 = replica.parse().ok()?;
        (k < self.replicas.get()).then_some((device, k))
    }
}

/// The EFA an advertised ID names, whatever the replica count it was advertised under: for
/// readers such as pod attribution, which see IDs the kubelet checkpointed long ago.
pub(crate) fn device_of(id: &str) -> &str {
    id.rsplit_once(SEPARATOR).map_or(id, |(device, _)| device)
}

/// Parses a replica count as given on the command line, in the environment or in the file.
pub(crate) fn parse_replicas(text: &str) -> Result<NonZeroU32, String> {
    let invalid = |why: &str| format!("invalid replica count {text:?}: {why}");
    let n: u32 = text
        .trim()
        .parse()
        .map_err(|_| invalid("expected a whole number"))?;
    match NonZeroU32::new(n) {
        None => Err(invalid("must be at least 1 (1 turns sharing off)")),
        Some(_) if n > MAX_REPLICAS => Err(invalid(&format!("must be at most {MAX_REPLICAS}"))),
        Some(n) => Ok(n),
    }
}

/// `n` replicas, for tests, which write the count as a literal.
#[cfg(test)]
pub(crate) fn shared(n: u32) -> Sharing {
    Sharing::replicas(NonZeroU32::new(n).expect("a sharing count is at least 1"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unshared_ids_are_the_pci_address() {
        let ids: Vec<String> = Sharing::default().advertised("0000:10:1b.0").collect();
        assert_eq!(ids, ["0000:10:1b.0"]);
        assert_eq!(
            Sharing::default().parse("0000:10:1b.0"),
            Some(("0000:10:1b.0", 0))
        );
    }

    #[test]
    fn every_advertised_replica_parses_back() {
        let sharing = shared(3);
        let ids: Vec<String> = sharing.advertised("0000:10:1b.0").collect();
        assert_eq!(
            ids,
            ["0000:10:1b.0::0", "0000:10:1b.0::1", "0000:10:1b.0::2"]
        );
        for (k, id) in ids.iter().enumerate() {
            assert_eq!(sharing.parse(id), Some(("0000:10:1b.0", k as u32)));
        }
    }

    #[test]
    fn ids_never_advertised_are_refused() {
        let sharing = shared(2);
        for id in [
            "0000:10:1b.0",
            "0000:10:1b.0::2",
            "0000:10:1b.0::01",
            "0000:10:1b.0::+1",
            "0000:10:1b.0::",
            "0000:10:1b.0::x",
        ] {
            assert_eq!(sharing.parse(id), None, "{id}");
        }
    }

    #[test]
    fn device_of_reads_both_spellings() {
        assert_eq!(device_of("0000:10:1b.0"), "0000:10:1b.0");
        assert_eq!(device_of("0000:10:1b.0::3"), "0000:10:1b.0");
    }

    #[test]
    fn replica_counts_are_validated() {
        assert_eq!(parse_replicas(" 4 ").unwrap().get(), 4);
        assert_eq!(parse_replicas("64").unwrap().get(), 64);
        for bad in ["0", "-1", "65", "two", ""] {
            assert!(parse_replicas(bad).is_err(), "{bad}");
        }
        assert!(parse_replicas("0").unwrap_err().contains("at least 1"));
    }
}
